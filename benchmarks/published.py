"""Published numbers the scaling model uses, embedded (no network access at run time).

Per-layer gradient bytes and FLOPs are computed from the published architectures (layer
shapes as in the papers; parameter counts and multiply-adds checked against the counts
the papers / torchvision publish, see tests/benchmarks). Per-GPU step times come from
published single-GPU throughputs; backprop time is spread over the layers in proportion
to their FLOPs (backward = 2x forward FLOPs, the usual rule for conv and dense layers).

Sources (cited by the constants below):

[He16]   He et al., "Deep Residual Learning for Image Recognition", CVPR 2016, Table 1
         (ResNet-50/101 layer shapes; 3.8 / 7.6 GFLOPs, counted as multiply-adds).
[SZ15]   Simonyan & Zisserman, "Very Deep Convolutional Networks...", ICLR 2015 (VGG-16, D).
[TV]     torchvision.models documentation: parameters 25,557,032 (resnet50), 44,549,160
         (resnet101), 138,357,544 (vgg16); GFLOPS 4.09, 7.80, 15.47 (multiply-adds).
[Vas17]  Vaswani et al., "Attention Is All You Need", NeurIPS 2017, Tables 3 and 4, 5.2:
         Transformer (big) d_model 1024, d_ff 4096, 16 heads, N = 6, 213 M parameters;
         8 P100 GPUs, ~25000 source + ~25000 target tokens per batch, 1.0 s per step.
[Hvd18]  Sergeev & Del Balso, "Horovod: fast and easy distributed deep learning in
         TensorFlow", arXiv:1802.05799, Fig. 6 and 7: up to 128 servers with 4 Pascal
         (P100) GPUs each, RoCE-capable 25 Gbit/s network, tf_cnn_benchmarks; ~88-90 %
         scaling efficiency for Inception V3 and ResNet-101 at 512 GPUs, 68 % for VGG-16.
         Horovod's tensor fusion: 64 MB buffer, 5 ms cycle (its documented defaults).
[TFB]    TensorFlow performance benchmarks page (tf_cnn_benchmarks, 2017), NVIDIA DGX-1
         (P100), synthetic data, batch 64 per GPU: ResNet-50 219, VGG-16 ~144 images/s.
[NV]     NVIDIA DeepLearningExamples, ResNet-50 v1.5 for TensorFlow: ~360 images/s per
         V100-16GB in FP32 (batch 128/256); NVIDIA V100 datasheet: 15.7 TFLOP/s FP32,
         NVLink 300 GB/s aggregate; NCCL all-reduce on DGX-1V reaches ~130 GB/s busbw.
[TNT]    Tarantella (cc-hpc-itwm/tarantella) project page: ResNet-50 57x on 96 V100 GPUs.
[IB]     InfiniBand EDR 100 Gb/s (12.5 GB/s line rate), MPI latency ~1-2 us per message.
"""

from __future__ import annotations

from dataclasses import dataclass

from stepsim import Engine, Grad, Jitter, Network, Profile

# -- networks (per-rank injection bandwidth at ~90 % of line rate; alpha per message) --------
NETWORKS = {
    "ib100": Network("100 Gb/s InfiniBand (EDR)", alpha_s=3e-6, beta_Bps=11.0e9,
                     note="[IB]: 12.5 GB/s line, 1-2 us MPI latency; 3 us with software"),
    "eth25": Network("25 Gb/s Ethernet (RoCE)", alpha_s=10e-6, beta_Bps=2.8e9,
                     note="[Hvd18]'s fabric: 3.125 GB/s line; 10 us per message"),
    "nvlink": Network("NVLink (V100, NVSwitch-like domain)", alpha_s=5e-6, beta_Bps=130e9,
                      note="[NV]: DGX-1V NCCL busbw ~130 GB/s; beyond 8-16 GPUs hypothetical"),
}

#: Lockstep jitter assumed for a GPU rank: sigma 1 % of the step per rank (no published
#: distribution; GPUs run a fixed kernel sequence; the doc shows the sensitivity).
GPU_JITTER_SIGMA = 0.01
#: A host-staging GPU port of tnt-comm copies each bucket over PCIe 3.0 x16 (~12 GB/s)
#: to the host and back (no CUDA-aware MPI assumed).
PCIE_Bps = 12e9


# -- architectures -------------------------------------------------------------------------
@dataclass(frozen=True)
class Layer:
    """One trainable layer in forward order: its gradient tensors' element counts and its
    forward multiply-adds per sample."""

    name: str
    counts: tuple[int, ...]
    macs: float


def _conv(name: str, k: int, cin: int, cout: int, hw_out: int, bn: bool = True, bias: bool = False
          ) -> Layer:
    counts = (k * k * cin * cout, *((cout,) if bias else ()), *((cout, cout) if bn else ()))
    return Layer(name, counts, k * k * cin * cout * hw_out * hw_out)


def _dense(name: str, fin: int, fout: int) -> Layer:
    return Layer(name, (fin * fout, fout), fin * fout)


def resnet_layers(depth: int) -> list[Layer]:
    """ResNet-50/101 (bottleneck, [He16] Table 1, stride in the 3x3 conv as in v1.5) for
    224x224 ImageNet: conv + batch-norm layers, then the 1000-way classifier."""
    blocks = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth]
    layers = [_conv("conv1", 7, 3, 64, 112)]
    cin, hw = 64, 56
    for stage, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
        for b in range(n):
            hw_out = hw // 2 if stage > 0 and b == 0 else hw
            p = f"s{stage + 2}b{b + 1}"
            layers += [_conv(f"{p}_1x1a", 1, cin, width, hw), _conv(f"{p}_3x3", 3, width, width, hw_out),
                       _conv(f"{p}_1x1b", 1, width, 4 * width, hw_out)]
            if b == 0:
                layers.append(_conv(f"{p}_proj", 1, cin, 4 * width, hw_out))
            cin, hw = 4 * width, hw_out
    # The projection's MACs are at the output resolution; the first 1x1 of a strided block
    # runs at the input resolution (counted above with hw before the stride).
    layers.append(_dense("fc", 2048, 1000))
    return layers


def vgg16_layers() -> list[Layer]:
    """VGG-16 (configuration D of [SZ15]) for 224x224: 13 convs with bias, 3 dense."""
    cfg = ((64, 224), (64, 224), (128, 112), (128, 112), (256, 56), (256, 56), (256, 56),
           (512, 28), (512, 28), (512, 28), (512, 14), (512, 14), (512, 14))
    layers, cin = [], 3
    for i, (cout, hw) in enumerate(cfg):
        layers.append(_conv(f"conv{i + 1}", 3, cin, cout, hw, bn=False, bias=True))
        cin = cout
    return [*layers, _dense("fc6", 512 * 7 * 7, 4096), _dense("fc7", 4096, 4096), _dense("fc8", 4096, 1000)]


def transformer_big_layers(vocab: int = 37000, d: int = 1024, ff: int = 4096, n: int = 6,
                           tokens_per_sample: int = 1) -> list[Layer]:
    """Transformer (big) of [Vas17], shared source/target/output embedding (one tensor,
    used first in the forward pass, so its gradient is complete only at the end of
    backprop; [Vas17]'s WMT EN-DE shared vocabulary of ~37000 BPE tokens gives 214 M
    parameters vs the published 213 M). MACs per token; the output projection reuses the
    embedding (counted at half the tokens: targets only)."""
    def attention(p: str) -> list[Layer]:
        return [Layer(f"{p}_{w}", (d * d, d), d * d) for w in ("q", "k", "v", "o")]

    def norm(p: str) -> Layer:
        return Layer(p, (d, d), 0.0)

    def ffn(p: str) -> list[Layer]:
        return [Layer(f"{p}_ff1", (d * ff, ff), d * ff), Layer(f"{p}_ff2", (ff * d, d), ff * d)]

    layers = [Layer("embedding", (vocab * d,), vocab * d / 2)]  # output projection, half the tokens
    for i in range(n):
        layers += [*attention(f"enc{i}_self"), norm(f"enc{i}_ln1"), *ffn(f"enc{i}"), norm(f"enc{i}_ln2")]
    layers.append(norm("enc_ln"))
    for i in range(n):
        layers += [*attention(f"dec{i}_self"), norm(f"dec{i}_ln1"), *attention(f"dec{i}_cross"),
                   norm(f"dec{i}_ln2"), *ffn(f"dec{i}"), norm(f"dec{i}_ln3")]
    layers.append(norm("dec_ln"))
    return layers


def params(layers: list[Layer]) -> int:
    return sum(sum(layer.counts) for layer in layers)


def macs(layers: list[Layer]) -> float:
    return sum(layer.macs for layer in layers)


def gpu_profile(name: str, layers: list[Layer], step_s: float, note: str) -> Profile:
    """A GPU rank's step: forward = 1/3 of ``step_s``, backward = 2/3, spread over the
    layers (last first) in proportion to their MACs; float32 gradients in backprop order
    (tnt-keras' slot order)."""
    forward, backward = step_s / 3, 2 * step_s / 3
    total = macs(layers) or 1.0
    grads: list[Grad] = []
    t = forward
    for layer in reversed(layers):
        t += backward * layer.macs / total
        grads += [Grad(f"{layer.name}/{j}", 4 * c, t) for j, c in enumerate(layer.counts)]
    return Profile(name, tuple(grads), step_s, 0.0, note)


# -- per-GPU step times ----------------------------------------------------------------------
V100_RESNET50_IPS = 360.0  # [NV], FP32
P100_RESNET50_IPS = 219.0  # [TFB]
P100_VGG16_IPS = 144.0  # [TFB]


def resnet50_v100(batch: int = 64) -> Profile:
    return gpu_profile("ResNet-50, V100 FP32", resnet_layers(50), batch / V100_RESNET50_IPS,
                       f"batch {batch}/GPU at {V100_RESNET50_IPS:.0f} images/s [NV]")


def resnet101_p100(batch: int = 64) -> Profile:
    # No ResNet-101 figure in [TFB]: ResNet-50's P100 speed scaled by the multiply-add ratio.
    ips = P100_RESNET50_IPS * macs(resnet_layers(50)) / macs(resnet_layers(101))
    return gpu_profile("ResNet-101, P100 FP32", resnet_layers(101), batch / ips,
                       f"batch {batch}/GPU at {ips:.0f} images/s ([TFB] ResNet-50 x MAC ratio)")


def vgg16_p100(batch: int = 64) -> Profile:
    return gpu_profile("VGG-16, P100 FP32", vgg16_layers(), batch / P100_VGG16_IPS,
                       f"batch {batch}/GPU at {P100_VGG16_IPS:.0f} images/s [TFB]")


def transformer_big_v100(tokens: int = 6250) -> Profile:
    """[Vas17]: 8 P100 at 1.0 s per step for ~50000 tokens = 6250 tokens per GPU-step;
    a V100 is taken as 15.7 / 9.3 = 1.69x a P100 (FP32 peak ratio, [NV])."""
    step = 1.0 * tokens / 6250 / (15.7 / 9.3)
    return gpu_profile("Transformer (big), V100 FP32", transformer_big_layers(), step,
                       f"{tokens} tokens/GPU, {step * 1e3:.0f} ms per step ([Vas17] P100 x 1.69)")


# -- engines of the published systems and of tnt on a GPU ------------------------------------
HOROVOD = Engine(threshold_bytes=64 << 20, k=1, per_bucket_s=0.0, copy_Bps=float("inf"),
                 cycle_s=5e-3, algorithms=("ring",))
# [Hvd18] defaults: 64 MB fusion buffer, 5 ms cycle; NCCL 2.0 (2017) had ring all-reduce only.


def tnt_gpu_engine(per_bucket_s: float, threshold_bytes: int = 8 << 20) -> Engine:
    """tnt-comm as built (a host engine) on a GPU rank: buckets staged over PCIe."""
    return Engine(threshold_bytes=threshold_bytes, k=float("inf"), per_bucket_s=per_bucket_s,
                  copy_Bps=PCIE_Bps, submit_blocks_compute=False)


@dataclass(frozen=True)
class Anchor:
    name: str
    published_eff: float
    ranks: int
    network: str
    source: str


ANCHORS = {
    "tarantella_resnet50_96_v100": Anchor("Tarantella ResNet-50, 96 V100", 57 / 96, 96, "ib100",
                                          "[TNT]: 57x on 96 GPUs (fabric and batch not stated; "
                                          "InfiniBand 100 Gb/s and batch 64/GPU assumed)"),
    "horovod_resnet101_512": Anchor("Horovod ResNet-101, 512 P100", 0.90, 512, "eth25", "[Hvd18] Fig. 6/7"),
    "horovod_vgg16_512": Anchor("Horovod VGG-16, 512 P100", 0.68, 512, "eth25", "[Hvd18] Fig. 7"),
}


def anchor_predictions(tnt_per_bucket_s: float = 20e-6) -> dict[str, dict]:
    """Each anchor predicted with the published hardware (deterministic)."""
    from stepsim import efficiency

    jitter = Jitter.normal(GPU_JITTER_SIGMA)
    cases = {
        "tarantella_resnet50_96_v100": (resnet50_v100(), tnt_gpu_engine(tnt_per_bucket_s)),
        "horovod_resnet101_512": (resnet101_p100(), HOROVOD),
        "horovod_vgg16_512": (vgg16_p100(), HOROVOD),
    }
    out = {}
    for key, (profile, engine) in cases.items():
        a = ANCHORS[key]
        eff = efficiency(profile, a.ranks, NETWORKS[a.network], engine, jitter)
        out[key] = {"name": a.name, "ranks": a.ranks, "network": a.network, "published": a.published_eff,
                    "predicted": eff, "error_pp": 100 * (eff - a.published_eff), "source": a.source,
                    "profile": profile.note}
    return out


#: Anchors the model misses by more than 10 points, and why (docs/benchmarks.md, "At scale").
EXPLAINED_MISSES = {
    "tarantella_resnet50_96_v100": (
        "The model predicts ~0.97 for weak scaling at batch 64/GPU on 100 Gb/s InfiniBand; the "
        "original's 57x (0.59) cannot come from gradient exchange on such a fabric: ResNet-50's "
        "102 MB take ~19 ms at 11 GB/s against ~120 ms of backprop. The published figure does not "
        "state fabric, batch or scaling mode; the original aimed at strong scaling (fixed global "
        "batch, so at 96 GPUs each GPU gets a small micro-batch and runs far below its full-batch "
        "speed), and its time includes the input pipeline. Neither is in this model."),
}
