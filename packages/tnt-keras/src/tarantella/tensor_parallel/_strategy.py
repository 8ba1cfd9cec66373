"""ParallelStrategy.TENSOR in the strategy registry: its options, build and load.

TENSOR splits the large layers over N == t ranks. ``tensor_parallel_size=1`` splits
nothing: the data-parallel wrapper runs. ALL (which also builds data replicas of tensor
groups with this subpackage's model and loads them with ``load_model``) is registered by
``tarantella.hybrid``.
"""

from __future__ import annotations

import keras

from .._core import internals as _internals
from .._core import runtime as _runtime
from .._core.deferred import is_deferred
from .._core.errors import TensorParallelError
from .._core.mesh import check_layout
from .._core.serial_files import deferred_from_file, open_model_file
from .._core.strategy import ParallelStrategy, Strategy, register
from ._model import TensorParallelModel
from ._plan import check_size
from ._saving import read_tensor_state

#: The options of a tensor group, declared once (ALL takes them with pipelining's).
OPTIONS = ("tensor_parallel_size", "tensor_parallel_plan")


def size_from_options(options: dict, member: ParallelStrategy) -> int:
    """The tensor group size t the options give (TENSOR must name it; a plan needs t > 1)."""
    if member is ParallelStrategy.TENSOR and "tensor_parallel_size" not in options:
        raise TensorParallelError("ParallelStrategy.TENSOR needs tensor_parallel_size= (the ranks sharing "
                                  "each split layer), e.g. tnt.Model(m, parallel_strategy=tnt.ParallelStrategy."
                                  "TENSOR, tensor_parallel_size=2).")
    t = check_size(options.get("tensor_parallel_size", 1))
    given_plan = options.get("tensor_parallel_plan") is not None or (
        member is ParallelStrategy.ALL and "tensor_parallel_plan" in options)
    if t == 1 and given_plan:
        raise TensorParallelError("tensor_parallel_plan needs tensor_parallel_size > 1 (the ranks sharing "
                                  "each split layer); pass tensor_parallel_size=plan.tensor_parallel_size.")
    return t


def build_tensor(model: keras.Model, member: ParallelStrategy, options: dict) -> keras.Model | None:
    """TENSOR: this rank's shards (None with t = 1 on one rank: nothing to split)."""
    t = size_from_options(options, member)
    if t == 1:
        check_layout("tensor", _runtime.get_size(), 1)
        return None
    return TensorParallelModel(model, tensor_parallel_size=t, tensor_parallel_plan=options.get("tensor_parallel_plan"),
                               parallel_strategy="tensor")



def load_model(filepath, *, tensor_parallel_size: int, tensor_parallel_plan=None, custom_objects=None,
               compile: bool = True, safe_mode: bool = True, parallel_strategy: str = "tensor", sharding: int = 0,
               **kwargs):
    """Load a ``.keras`` file (saved serially or tensor-parallel at any t) split over
    ``tensor_parallel_size`` ranks; each rank reads only its slices of the split layers.

    ``tensor_parallel_plan``: a plan of the file's model (default: the automatic plan).
    ``parallel_strategy="all"``: data replicas of such groups (N a multiple of t; every
    replica reads the same slices); ``sharding=1|2`` then keeps on each replica the optimizer
    state of the variables it owns in its replica group, read from the file's whole state.
    """
    strategy = getattr(parallel_strategy, "value", parallel_strategy)
    if kwargs:
        raise TensorParallelError(f"tnt.models.load_model(parallel_strategy=TENSOR) got unknown keyword "
                                  f"argument(s) {sorted(kwargs)}; it takes tensor_parallel_size=, "
                                  "tensor_parallel_plan=, custom_objects=, compile= and safe_mode=.")
    with open_model_file(filepath) as (local, archive):
        if archive is None:
            raise TensorParallelError(f"{filepath} is not a .keras file: tnt.models.load_model(parallel_strategy="
                                      "TENSOR) loads .keras files (use model.load_weights for .weights.h5).")
        full = deferred_from_file(archive, custom_objects, compile, safe_mode)
        model = TensorParallelModel(full, tensor_parallel_size=tensor_parallel_size, parallel_strategy=strategy,
                                    tensor_parallel_plan=tensor_parallel_plan, sharding=sharding,
                                    _weights_from_file=True)
        split = {id(s) for s, _, _ in model._split_variables()}
        for var in full.variables:  # replicated layers (and seeds): real variables, read below
            if is_deferred(var) and id(var) not in split:
                _internals.initialize_deferred(var)
        full_optimizer = None
        if compile and full.compiled:
            args = keras.saving.deserialize_keras_object(full.get_compile_config())
            args.pop("jit_compile", None)
            model.compile(**args)
            full_optimizer = full.optimizer
        read_tensor_state(model, full, full_optimizer, _internals.weights_store(local, archive))
    return model


def load_tensor(filepath, member: ParallelStrategy, options: dict, **kwargs) -> keras.Model | None:
    """TENSOR: the file split over q ranks (None with q = 1: loaded whole)."""
    t = size_from_options(options, member)
    if t == 1:
        check_layout("tensor", _runtime.get_size(), 1)
        return None
    return load_model(filepath, parallel_strategy="tensor", **options, **kwargs)


register(Strategy(name="tensor", handles=(ParallelStrategy.TENSOR,), options=OPTIONS,
                  error=TensorParallelError, build=build_tensor, load=load_tensor))
