"""Every example of examples/ runs at a tiny size on 2 ranks and reaches what a working run
reaches. (examples/lenet5.py, the README's main job, runs from the installed wheels in
tests/packaging; the GAN in tnt-keras' suite.)"""

from __future__ import annotations

import re

from launch import ROOT, explain, tarantella

EXAMPLES = ROOT / "examples"


def _result(line_pattern: str, stdout: str) -> re.Match:
    found = re.search(line_pattern, stdout)
    assert found, f"no result line matching {line_pattern!r} in:\n{stdout[-4000:]}"
    return found


def test_resnet50_learns_synthetic_classes(tmp_path):
    # 3 epochs of 6 steps at 32x32: the learning-rate warm-up and decay, ModelCheckpoint
    # and BackupAndRestore all run; 4 classes of coloured noise are learnt past chance.
    proc = tarantella(2, EXAMPLES / "resnet50.py", "--steps", "6", "--epochs", "3",
                      "--image-size", "32", "--classes", "4", "--micro-batch-size", "8",
                      "--learning-rate", "0.0005", "--warmup-steps", "2",
                      "--workdir", str(tmp_path))
    assert proc.returncode == 0, explain(proc)
    found = _result(r"ranks: (\d+)\s+global batch: (\d+)\s+peak lr: ([\d.e-]+)\s+"
                    r"train accuracy: ([\d.]+).*checkpoint: (\w+)", proc.stdout)
    assert (int(found.group(1)), int(found.group(2))) == (2, 16)  # micro-batch x ranks
    assert float(found.group(3)) == 0.001  # learning rate scaled with the ranks
    # Chance is 0.25; working runs reach 0.5-0.8 in the last epoch (1 or 2 ranks).
    assert float(found.group(4)) >= 0.45, proc.stdout[-3000:]
    assert found.group(5) == "yes"
    assert (tmp_path / "resnet50.keras").is_file()
    # BackupAndRestore deletes its backup when training completes.
    assert not (tmp_path / "backup" / "latest.weights.h5").exists()


def test_transformer_reverses_sequences(tmp_path):
    proc = tarantella(2, EXAMPLES / "transformer.py", "--samples", "2048", "--epochs", "4",
                      "--length", "6", "--width", "32", cwd=tmp_path)
    assert proc.returncode == 0, explain(proc)
    found = _result(r"ranks: (\d+)\s+train loss: [\d.]+\s+greedy token accuracy: ([\d.]+)\s+"
                    r"exact sequences: ([\d.]+)", proc.stdout)
    assert int(found.group(1)) == 2
    # Greedy decoding by the serial inference model: reversing is learnt almost perfectly
    # (a model that copied instead of reversing would score ~1/11 per token).
    assert float(found.group(2)) >= 0.95, proc.stdout[-3000:]
    assert float(found.group(3)) >= 0.8, proc.stdout[-3000:]
