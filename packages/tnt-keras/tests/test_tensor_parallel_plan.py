"""Tensor-parallel plans without launching: edited plans, LayoutMaps, layouts, errors.

Single process: a plan is a pure function of the model (every rank computes the same),
and the layout and option checks run before any communication.
"""

from __future__ import annotations

import logging

import keras
import pytest

import tarantella as tnt
from tarantella.tensor_parallel import (
    SUPPORTED,
    TensorParallelError,
    check_layout,
    from_layout_map,
    plan,
)

ALL = tnt.ParallelStrategy.ALL


def mlp() -> keras.Model:
    """up1 -> down1 (pair), up2 -> tanh -> down2 (pair), head (lone, softmax)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((10,))
    h = keras.layers.Dense(16, activation="relu", name="up1")(x)
    h = keras.layers.Dense(12, name="down1")(h)
    h = keras.layers.Dense(24, name="up2")(h)
    h = keras.layers.Activation("tanh", name="act")(h)
    h = keras.layers.Dense(8, activation="relu", name="down2")(h)
    return keras.Model(x, keras.layers.Dense(4, activation="softmax", name="head")(h), name="mlp")


def block() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((6,), dtype="int32")
    e = keras.layers.Embedding(30, 16, name="emb")(x)
    a = keras.layers.MultiHeadAttention(4, 4, name="mha")(e, e)
    h = keras.layers.LayerNormalization(name="ln")(keras.layers.Add()([e, a]))
    f = keras.layers.Dense(32, activation="relu", name="ffn_up")(h)
    f = keras.layers.Dropout(0.1, name="ffn_drop")(f)
    f = keras.layers.Dense(16, name="ffn_down")(f)
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Add()([h, f]))
    return keras.Model(x, keras.layers.Dense(4, name="head")(pooled), name="block")


MLP_AUTO = {"up1": "column", "down1": "row", "up2": "column", "down2": "row", "head": "column+allgather"}
BLOCK_AUTO = {"emb": "vocab", "mha": "heads", "ffn_up": "column", "ffn_down": "row", "head": "column+allgather"}


def megatron_map(device_mesh=None) -> keras.distribution.LayoutMap:
    """The Keras-convention layouts of a Megatron split (what a JAX ModelParallel user writes)."""
    m = keras.distribution.LayoutMap(device_mesh)
    m["emb/embeddings"] = ("model", None)
    m["mha/(query|key|value)/kernel"] = (None, "model", None)
    m["mha/(query|key|value)/bias"] = ("model", None)
    m["mha/attention_output/kernel"] = ("model", None, None)
    m[r"(up\d|ffn_up|head)/kernel"] = (None, "model")
    m[r"(up\d|ffn_up|head)/bias"] = ("model",)
    m[r"(down\d|ffn_down)/kernel"] = ("model", None)
    return m


# -- edited plans ----------------------------------------------------------------------------------------
def test_replicating_one_half_of_a_pair_replicates_both():
    p = plan(mlp(), tensor_parallel_size=2, min_split_params=0).replicate("down1")
    assert p.split_layers() == {"up2": "column", "down2": "row", "head": "column+allgather"}
    text = p.summary(print_fn=lambda s: None)
    assert "replicated by plan.replicate (pair of down1)" in text
    assert p.params_per_rank() < sum(s.params for s in p.layers)


def test_split_chooses_column_row_and_allgather():
    p = plan(mlp(), tensor_parallel_size=2)  # default: the small lone head stays replicated
    assert p.kind("head") == "replicated"
    p.replicate("up1", "up2").split("head", "column+allgather")
    assert p.split_layers() == {"head": "column+allgather"}
    p.split({"up2": "column", "down2": "row"})
    assert p.split_layers() == {"up2": "column", "down2": "row", "head": "column+allgather"}
    assert [s.partner for s in p.layers if s.name in ("up2", "down2")] == ["down2", "up2"]


def test_edited_plan_keeps_the_dropout_between_a_pair_split():
    p = plan(block(), tensor_parallel_size=2, min_split_params=0)
    assert p.replicate("ffn_up").split_dropouts == []
    assert p.split({"ffn_up": "column", "ffn_down": "row"}).split_dropouts == ["ffn_drop"]


@pytest.mark.parametrize(("edit", "words"), [
    (lambda p: p.split("up1", "column+allgather"), ["'down1'", "'row'", "must come from"]),
    (lambda p: p.replicate("down1").split("up1", "column"), ["'up1'", "split 'down1' as 'row'", SUPPORTED]),
    (lambda p: p.replicate("up1").split("down1", "row"), ["'down1'", "must come from a Dense split as 'column'"]),
    (lambda p: p.split("head", "vocab"), ["'head'", "needs a keras.layers.Embedding", SUPPORTED]),
    (lambda p: p.split("head", "diagonal"), ["unknown split 'diagonal'"]),
    (lambda p: p.split("act", "column"), ["no layer with weights named 'act'"]),
    (lambda p: p.replicate("nope"), ["no layer with weights named 'nope'", "up1"]),
])
def test_unsupported_edits_name_the_layer_and_the_patterns(edit, words):
    p = plan(mlp(), tensor_parallel_size=2, min_split_params=0)
    with pytest.raises(TensorParallelError) as err:
        edit(p)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_split_that_does_not_divide_is_refused_when_asked_for():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="five")], name="odd")
    with pytest.raises(TensorParallelError, match="'five' cannot be split as 'column\\+allgather': split "
                                                  "dimension 5 does not divide by t=2"):
        plan(model, tensor_parallel_size=2).split("five", "column+allgather")


# -- LayoutMap -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("build", "expected", "dropouts"), [(mlp, MLP_AUTO, []), (block, BLOCK_AUTO, ["ffn_drop"])])
def test_megatron_layout_map_gives_the_automatic_plan(build, expected, dropouts):
    model = build()
    p = from_layout_map(megatron_map(), model, 2)
    assert p.split_layers() == expected
    assert p.split_dropouts == dropouts
    assert p.split_layers() == plan(model, tensor_parallel_size=2, min_split_params=0).split_layers()


def test_layout_map_column_without_row_is_allgathered_and_unmatched_is_replicated():
    m = keras.distribution.LayoutMap(None)
    m["up1/kernel"] = (None, "model")          # bias unmatched: split with its columns anyway
    m["down2/kernel"] = (None, None)
    assert from_layout_map(m, mlp(), 2).split_layers() == {"up1": "column+allgather"}


@pytest.mark.parametrize(("key", "layout", "words"), [
    ("up1/kernel", ("model", "model"), ["'up1'", "one dimension only", "'model'"]),
    ("up1/kernel", ("seq", None), ["'up1'", "'seq'", "tensor axis 'model'", "data axes ['batch']"]),
    ("up1/kernel", (None,), ["'up1'", "2 dimensions", "one entry"]),
    ("down1/bias", ("model",), ["'down1'", "not a supported pattern", SUPPORTED]),
])
def test_unsupported_layouts_name_the_layer(key, layout, words):
    m = keras.distribution.LayoutMap(None)
    m[key] = layout
    with pytest.raises(TensorParallelError) as err:
        from_layout_map(m, mlp(), 2)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_layout_map_errors_for_embedding_columns_and_partial_attention():
    m = keras.distribution.LayoutMap(None)
    m["emb/embeddings"] = (None, "model")
    with pytest.raises(TensorParallelError, match=r"layer 'emb' \(Embedding\).*not a supported pattern"):
        from_layout_map(m, block(), 2)
    m = keras.distribution.LayoutMap(None)
    m["mha/query/kernel"] = (None, "model", None)
    with pytest.raises(TensorParallelError, match=r"layer 'mha' \(MultiHeadAttention\).*not a supported"):
        from_layout_map(m, block(), 2)


def test_layout_map_row_without_column_is_refused():
    m = keras.distribution.LayoutMap(None)
    m["down1/kernel"] = ("model", None)
    with pytest.raises(TensorParallelError, match="'down1' cannot be split as 'row'"):
        from_layout_map(m, mlp(), 2)


def test_layout_map_mesh_must_match_t():
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    assert from_layout_map(megatron_map(mesh), mlp(), 2).split_layers() == MLP_AUTO
    with pytest.raises(TensorParallelError, match="2 devices on the 'model' axis but tensor_parallel_size=4"):
        from_layout_map(megatron_map(mesh), mlp(), 4)


# -- layouts and options ---------------------------------------------------------------------------------
def test_layout_of_data_replicas_of_tensor_groups():
    layout = check_layout("all", 4, 2)
    assert layout.replicas == 2
    assert [(layout.replica(r), layout.shard(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert check_layout("tensor", 2, 2).replicas == 1


def test_layout_of_replicas_of_pipeline_stages_of_tensor_groups():
    layout = check_layout("all", 8, 2, 2)   # rank = (replica * p + stage) * t + shard
    assert layout.replicas == 2
    assert [(layout.replica(r), layout.stage(r), layout.shard(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]


@pytest.mark.parametrize(("args", "words"), [
    (("tensor", 4, 2), ["tarantella -n 2", "ParallelStrategy.ALL"]),
    (("all", 4, 3), ["4 rank(s) is not a multiple of tensor_parallel_size=3", "tarantella -n 6"]),
    (("all", 6, 2, 2), ["6 rank(s) is not a multiple of tensor_parallel_size=2 x num_pipeline_stages=2 = 4",
                        "tarantella -n 8"]),
])
def test_layout_errors(args, words):
    with pytest.raises(TensorParallelError) as err:
        check_layout(*args)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(tensor_parallel_size=0), ["integer >= 1"]),
    (dict(tensor_parallel_size=2), ["1 rank(s) is not a multiple of tensor_parallel_size=2"]),
    (dict(tensor_parallel_size=2, num_pipeline_stages=2), ["1 rank(s) is not a multiple of",
                                                           "num_pipeline_stages=2 = 4"]),
    (dict(tensor_parallel_size=2, num_micro_batches=4), ["num_micro_batches apply to pipeline stages",
                                                         "num_pipeline_stages=p"]),
    (dict(tensor_parallel_size=2, pipeline_stages=2), ["unknown keyword argument(s): pipeline_stages",
                                                       "num_pipeline_stages="]),
    (dict(tensor_parallel_plan=None), ["tensor_parallel_plan needs tensor_parallel_size > 1"]),
])
def test_all_with_tensor_groups_option_errors(kwargs, words):
    with pytest.raises(TensorParallelError) as err:
        tnt.Model(mlp(), parallel_strategy=ALL, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_all_with_split_layer_markers_and_tensor_groups_needs_p_times_t_ranks():
    x = keras.Input((4,))
    h = tnt.keras.layers.SplitLayer(name="cut")(keras.layers.Dense(8, name="a")(x))
    model = keras.Model(x, keras.layers.Dense(2, name="b")(h), name="marked")
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=2 x num_pipeline_stages=2 = 4"):
        tnt.Model(model, parallel_strategy=ALL, tensor_parallel_size=2)


def test_load_model_into_pipeline_stages_of_tensor_groups_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(TensorParallelError, match=r"not available yet.*keras\.saving\.load_model on every rank"):
        tnt.models.load_model(tmp_path / "m.keras", parallel_strategy=ALL, tensor_parallel_size=2,
                              num_pipeline_stages=2)


def test_column_row_pair_across_pipeline_stages_is_refused():
    model = mlp()
    cut = tnt.pipelining.plan(model, split_after=["up2"])   # up2 (column) | act, down2 (row)
    with pytest.raises(TensorParallelError, match=r"'up2' \(column-split\) is on pipeline stage 0 and its "
                                                  r"row-split partner 'down2' on stage 1.*plan.replicate\('up2'\)"):
        tnt.Model(model, parallel_strategy=ALL, tensor_parallel_size=2, pipeline_plan=cut)
    from tarantella.hybrid import check_pairs_in_one_stage

    check_pairs_in_one_stage(plan(model, tensor_parallel_size=2),   # cut between the pairs: fine
                             tnt.pipelining.plan(model, split_after=["down1"]))


def test_plan_for_another_t_or_model_is_refused():
    from tarantella.tensor_parallel._layout_map import as_plan

    p = plan(mlp(), tensor_parallel_size=2)
    with pytest.raises(TensorParallelError, match="made for tensor_parallel_size=2 but tensor_parallel_size=4"):
        as_plan(p, mlp(), 4)
    with pytest.raises(TensorParallelError, match="plan of model 'mlp', not of 'block'"):
        as_plan(p, block(), 2)
    with pytest.raises(TensorParallelError, match=r"a tnt\.tensor_parallel\.Plan or a keras\.distribution\.LayoutMap"):
        as_plan({"up1": "column"}, mlp(), 2)


# -- real models: keras-hub layers (issue 27) ---------------------------------------------------
def _hub_head(backbone, names: list[str]) -> keras.Model:
    """As jobs/real_models.py: the backbone's sequence output, mean-pooled, into a softmax."""
    inputs = {n: keras.Input((8,), dtype="int32", name=n) for n in names}
    out = backbone(inputs)
    x = keras.layers.GlobalAveragePooling1D()(out["sequence_output"] if isinstance(out, dict) else out)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def gpt2_head() -> keras.Model:
    import keras_hub  # a test dependency (issue 27)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=24, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8, dropout=0.0)
    return _hub_head(backbone, ["token_ids", "padding_mask"])


def test_keras_hub_gpt2_blocks_split_inside_the_nested_backbone():
    p = plan(gpt2_head(), 2)
    assert [(s.name, s.kind) for s in p.layers][:5] == [
        ("token_embedding", "replicated"), ("position_embedding", "replicated"), ("transformer_layer_0", "block"),
        ("transformer_layer_1", "block"), ("layer_norm", "replicated")]
    assert [(s.class_name, s.kind) for s in p.layers][5:] == [("Dense", "replicated")]  # the head: 3 columns
    block0 = next(s for s in p.layers if s.name == "transformer_layer_0")
    # q/k/v kernels + biases (3 * 272), attention output kernel (256), FFN in (16*32 + 32), FFN out kernel (512)
    assert block0.split_params == 3 * 272 + 256 + 544 + 512
    serial = sum(s.params for s in p.layers)
    assert serial == 5043 and p.params_per_rank() == 2915  # 0.578 of the weights on each rank
    assert p.collectives_per_step() == (4, 4)


def test_keras_hub_bert_with_keras_op_nodes_is_planned():
    import keras_hub  # a test dependency (issue 27)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=24, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8, dropout=0.0)
    p = plan(_hub_head(backbone, ["token_ids", "segment_ids", "padding_mask"]), 2)  # x[:, 0] is a GetItem op
    assert p.split_layers() == {"transformer_layer_0": "block"}
    assert p.kind("pooled_dense") == "replicated"


def test_reversible_embedding_splits_by_vocabulary_and_its_tied_reverse_call_counts_once():
    import keras_hub  # a test dependency (issue 27)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=24, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)  # token_embedding called twice
    auto = plan(lm, 2)
    assert auto.kind("token_embedding") == "replicated" and "min_split_params" in \
        next(s.note for s in auto.layers if s.name == "token_embedding")
    assert plan(lm, 2, min_split_params=0).kind("token_embedding") == "vocab"
    edited = auto.split("token_embedding", "vocab")
    assert edited.split_layers() == {"token_embedding": "vocab", "transformer_layer_0": "block"}
    with pytest.raises(TensorParallelError, match="'block' split needs a keras-hub TransformerEncoder"):
        auto.split("layer_norm", "block")


def test_top_level_cached_attention_splits_by_heads_and_cross_attention_blocks_stay_whole():
    import keras_hub  # a test dependency (issue 27)
    x = keras.Input((6, 8))
    memory = keras.Input((5, 8))
    a = keras_hub.layers.CachedMultiHeadAttention(2, 4, name="cached")(x, x)
    d = keras_hub.layers.TransformerDecoder(16, 2, name="cross")(a, memory)
    p = plan(keras.Model([x, memory], d), 2)
    assert p.kind("cached") == "heads"
    assert p.kind("cross") == "replicated"
    assert "cross-attention" in next(s.note for s in p.layers if s.name == "cross")


def test_summary_lists_bytes_and_warns_when_most_bytes_stay_replicated():
    text = plan(gpt2_head(), 2).summary(print_fn=lambda s: None)
    assert "bytes" in text.splitlines()[1]
    assert "position_embedding       PositionEmbedding    replicated               128        128        512" in text
    assert "replicated (whole on every rank): 2380 of 20172 bytes (0.12)" in text
    assert "WARNING" not in text  # 12 % stays replicated
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(100, name="wide")(x))
    small = keras.Model(x, keras.layers.Dense(4, name="out")(h))
    p = plan(small, 2)
    assert p.split_layers() == {}
    assert p.replicated_bytes() == p.total_bytes() == 4 * (7 * 100 + 200 + 404)
    warning = p.replicated_warning()
    assert warning.startswith("100% of the weights' bytes") and "wide (Dense, 2800 B: smaller than" in warning
    assert "WARNING: 100%" in p.summary(print_fn=lambda s: None)


def test_plans_compare_by_position_not_by_auto_generated_names():
    from tarantella.tensor_parallel._agreement import first_difference, plan_signature

    def unnamed(width: int) -> keras.Model:
        x = keras.Input((6,))
        h = keras.layers.Dense(width, activation="relu")(x)
        return keras.Model(x, keras.layers.Dense(6)(h))

    a, b = plan(unnamed(8), 2), plan(unnamed(8), 2)
    assert [s.name for s in a.layers] != [s.name for s in b.layers]  # Keras numbered them apart
    assert first_difference([plan_signature(a), plan_signature(b)]) is None
    assert first_difference([plan_signature(a), plan_signature(b), plan_signature(plan(unnamed(12), 2))]) == (2, 0)


def test_keras_hub_layout_map_is_accepted_with_its_batch_axis_as_replicas():
    import keras_hub  # a test dependency (issue 27)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=24, num_layers=2, num_query_heads=2,
                                              num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    model = _hub_head(backbone, ["token_ids", "padding_mask"])
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)  # token embedding ("model", "batch")
    p = from_layout_map(layout_map, model, 2)
    assert p.split_layers() == {"token_embedding": "vocab", "transformer_layer_0": "ffn", "transformer_layer_1": "ffn"}
    assert p.split_layers() == plan(model, 2, min_split_params=0).split_layers()
    block0 = next(s for s in p.layers if s.name == "transformer_layer_0")
    assert block0.split_params == 3 * 16 * 32  # gate, intermediate, output kernels; attention whole (GQA)
    assert p.replicated_warning() == ""
    m = keras.distribution.LayoutMap(None)  # "batch" without a mesh: data replicas too
    m["up1/kernel"] = ("batch", None)
    assert from_layout_map(m, mlp(), 2).split_layers() == {}


def test_layout_map_splits_keras_hub_blocks():
    m = keras.distribution.LayoutMap(None)
    m["transformer_layer_1/feedforward_intermediate_dense/kernel"] = (None, "model")
    m["token_embedding/embeddings"] = ("model", None)
    p = from_layout_map(m, gpt2_head(), 2)
    assert p.split_layers() == {"token_embedding": "vocab", "transformer_layer_1": "block"}


def test_a_plan_keeping_most_bytes_whole_is_logged_when_the_model_is_wrapped(caplog):
    from tarantella.tensor_parallel._layout_map import as_plan

    x = keras.Input((6,))
    h = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(100, name="wide")(x))
    small = keras.Model(x, keras.layers.Dense(4, name="out")(h))  # nothing split: 100 % whole
    logger = logging.getLogger("tarantella")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="tarantella"):
            as_plan(None, small, 2)
            as_plan(None, mlp(), 2)  # everything split: no warning
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r.getMessage() for r in caplog.records if "stay replicated" in r.getMessage()]
    assert len(warnings) == 1 and "100%" in warnings[0] and "wide (Dense, 2800 B" in warnings[0], warnings


def test_a_keras_hub_layer_without_a_tnt_split_is_kept_whole_from_a_layout_map_and_noted():
    import keras_hub  # a test dependency (issue 27)
    x = keras.Input((6, 8))
    model = keras.Model(x, keras_hub.layers.PositionEmbedding(6, name="pos")(x))
    m = keras.distribution.LayoutMap(None)
    m["pos/embeddings"] = ("model", None)
    p = from_layout_map(m, model, 2)
    assert p.split_layers() == {}
    note = p.layers[0].note
    assert note == "the LayoutMap splits ['embeddings'], but tnt has no split for a PositionEmbedding: kept whole"
    assert "stay replicated on every rank" in p.replicated_warning()


# -- grouped-query attention (keras-hub Llama) and EinsumDense projections -----------------------
def llama_head(num_key_value_heads: int = 2) -> keras.Model:
    """LlamaBackbone (vocabulary 64, 2 blocks, 4 query heads, hidden 16, FFN 32) + pooled head."""
    import keras_hub  # a test dependency (issue 27)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=num_key_value_heads, hidden_dim=16,
                                              intermediate_dim=32)
    return _hub_head(backbone, ["token_ids", "padding_mask"])


def test_llama_blocks_split_their_grouped_query_attention_by_heads():
    p = plan(llama_head(), 2)
    assert p.split_layers() == {"transformer_layer_0": "block", "transformer_layer_1": "block"}
    block0 = next(s for s in p.layers if s.name == "transformer_layer_0")
    # query 16*4*4, key and value 16*2*4 each, attention output 4*4*16; gate, intermediate, output 16*32 each
    assert block0.split_params == 256 + 2 * 128 + 256 + 3 * 512
    serial = 2 * 64 * 16 + 2 * (block0.split_params + 2 * 16) + 16 + 16 * 3 + 3
    assert sum(s.params for s in p.layers) == serial == 6787
    assert p.params_per_rank() == serial - 2 * block0.split_params // 2 == 4483  # 0.66: the embedding whole
    small = plan(llama_head(), 2, min_split_params=1024)
    assert small.split_layers()["token_embedding"] == "vocab"
    assert small.params_per_rank() == 4483 - 2 * 64 * 16 // 2 == 3459  # 0.51 of the weights per rank
    assert plan(llama_head(), 2).split("transformer_layer_0", "ffn").kind("transformer_layer_0") == "ffn"


def test_llama_heads_not_divisible_keep_the_attention_whole_with_a_warning(caplog):
    logger = logging.getLogger("tarantella")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="tarantella"):
            p = plan(llama_head(num_key_value_heads=1), 2)
    finally:
        logger.removeHandler(caplog.handler)
    assert p.split_layers() == {"transformer_layer_0": "ffn", "transformer_layer_1": "ffn"}
    note = next(s.note for s in p.layers if s.name == "transformer_layer_0")
    assert "num_key_value_heads 1 must both divide by t=2" in note, note
    warned = [r.getMessage() for r in caplog.records if "keeps its attention whole" in r.getMessage()]
    assert len(warned) == 2 and "num_key_value_heads 1" in warned[0], warned
    with pytest.raises(TensorParallelError, match="num_query_heads 4 and num_key_value_heads 1 must both divide"):
        p.split("transformer_layer_0", "block")
    assert plan(llama_head(), 4).kind("transformer_layer_0") == "ffn"  # 2 key/value heads over 4 ranks


def test_keras_hub_llama_layout_map_splits_grouped_query_attention_when_the_heads_divide():
    import keras_hub  # a test dependency (issue 27)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    model = llama_head()
    p = from_layout_map(keras_hub.models.LlamaBackbone.get_layout_map(mesh), model, 2)
    assert p.split_layers() == {"token_embedding": "vocab", "transformer_layer_0": "block",
                                "transformer_layer_1": "block"}
    assert p.split_layers() == plan(model, 2, min_split_params=0).split_layers()


@pytest.mark.parametrize("equation, bias_axes, plain", [
    ("abc,cd->abd", "d", True), ("ab,bc->ac", None, True), ("...b,bc->...c", "c", True),
    ("abc,cd->abd", "b", False), ("abc,cd->adb", None, False), ("abc,bd->acd", None, False),
    ("abc,cde->abde", None, False), ("abc,cc->abc", None, False)])
def test_plain_projection_equations(equation, bias_axes, plain):
    from tarantella.tensor_parallel._plan import plain_projection

    assert plain_projection(equation, bias_axes) is plain


def test_einsum_dense_projections_split_as_dense_and_others_stay_whole():
    keras.utils.set_random_seed(0)
    x = keras.Input((6, 10))
    h = keras.layers.EinsumDense("abc,cd->abd", (6, 16), bias_axes="d", activation="relu", name="up")(x)
    h = keras.layers.Dense(10, name="down")(h)
    h = keras.layers.EinsumDense("abc,cd->abd", (6, 8), activation="softmax", name="lone")(h)
    h = keras.layers.EinsumDense("abc,ce->abe", (6, 8), name="up2")(h)
    h = keras.layers.EinsumDense("abc,cd->abd", (6, 8), name="down2")(h)
    y = keras.layers.EinsumDense("abc,bd->acd", (8, 4), name="mixing")(h)  # contracts the sequence axis
    p = plan(keras.Model(x, y), 2, min_split_params=0)
    assert p.split_layers() == {"up": "column", "down": "row", "lone": "column+allgather", "up2": "column",
                                "down2": "row"}
    assert "is not a projection of the last axis" in next(s.note for s in p.layers if s.name == "mixing")
    with pytest.raises(TensorParallelError, match="an EinsumDense projecting the last axis"):
        p.split("mixing", "column+allgather")


# -- keras-hub Gemma: heads-first grouped-query attention, gated FFN -------------------------------
def gemma_head(num_key_value_heads: int = 2) -> keras.Model:
    """GemmaBackbone (vocabulary 64, 2 blocks, 4 query heads of size 8, hidden 32, FFN 64) + pooled head."""
    import keras_hub  # a test dependency (issue 27)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=num_key_value_heads, head_dim=8, hidden_dim=32,
                                              intermediate_dim=64)
    return _hub_head(backbone, ["token_ids", "padding_mask"])


def test_gemma_blocks_split_their_attention_by_heads_and_their_gated_ffn_column_row():
    p = plan(gemma_head(), 2)
    assert p.split_layers() == {"decoder_block_0": "block", "decoder_block_1": "block"}
    block0 = next(s for s in p.layers if s.name == "decoder_block_0")
    # query 4*32*8, key and value 2*32*8 each, output 4*8*32; ffw_gating, ffw_gating_2, ffw_linear 32*32 each
    assert block0.split_params == 1024 + 2 * 512 + 1024 + 3 * 1024
    serial = 64 * 32 + 2 * (block0.split_params + 2 * 32) + 32 + 32 * 3 + 3
    assert sum(s.params for s in p.layers) == serial == 14595
    assert p.params_per_rank() == serial - 2 * block0.split_params // 2 == 8451  # 0.58: the embedding whole
    assert plan(gemma_head(), 2, min_split_params=1024).params_per_rank() == 8451 - 64 * 32 // 2 == 7427
    assert p.collectives_per_step() == (4, 4)  # per block: attention output and ffw_linear; f before each
    assert plan(gemma_head(), 2).split("decoder_block_0", "ffn").kind("decoder_block_0") == "ffn"


def test_gemma_heads_not_divisible_keep_the_attention_whole_with_a_warning(caplog):
    logger = logging.getLogger("tarantella")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="tarantella"):
            p = plan(gemma_head(num_key_value_heads=1), 2)
    finally:
        logger.removeHandler(caplog.handler)
    assert p.split_layers() == {"decoder_block_0": "ffn", "decoder_block_1": "ffn"}
    block0 = next(s for s in p.layers if s.name == "decoder_block_0")
    assert block0.split_params == 3 * 1024  # the gated FFN only
    warned = [r.getMessage() for r in caplog.records if "keeps its attention whole" in r.getMessage()]
    assert len(warned) == 2 and "num_query_heads 4 and num_key_value_heads 1 must both divide by t=2" in warned[0]
    with pytest.raises(TensorParallelError, match="num_query_heads 4 and num_key_value_heads 1 must both divide"):
        p.split("decoder_block_0", "block")
    assert plan(gemma_head(), 4).kind("decoder_block_0") == "ffn"  # 2 key/value heads over 4 ranks


def test_gemma_projection_of_another_layout_is_refused_naming_it():
    model = gemma_head()
    backbone = next(layer for layer in model.layers if layer.name.startswith("gemma_backbone"))
    attention = backbone.get_layer("decoder_block_0").attention
    attention.query_dense.equation = "btd,dnh->btnh"  # as another keras-hub version might write it
    p = plan(model, 2)
    assert p.kind("decoder_block_0") == "ffn"
    assert "its query_dense projection is not 'btd,ndh->btnh'" in p.layers[1].note, p.layers[1].note


def test_keras_hub_gemma_layout_map_gives_the_automatic_plan():
    import keras_hub  # a test dependency (issue 27)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    model = gemma_head()
    p = from_layout_map(keras_hub.models.GemmaBackbone.get_layout_map(mesh), model, 2)
    assert p.split_layers() == {"token_embedding": "vocab", "decoder_block_0": "block", "decoder_block_1": "block"}
    assert p.split_layers() == plan(model, 2, min_split_params=0).split_layers()
