"""Every use of a private Keras or TensorFlow name in tnt-keras, in one place.

Keras 3 keeps some things tnt needs off its public API (the loss tracker of the default
step, the array data adapter whose shuffle order serial Keras uses, BackupAndRestore's
file paths, TensorFlow's global seed). They are read only here, for the tested version
range below; outside it, the first use raises :class:`UnsupportedVersionError` naming the
versions, instead of failing somewhere deep in a step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import tensorflow as tf

#: Keras versions these internals were checked against (inclusive lower, exclusive upper).
TESTED_KERAS = ((3, 5), (3, 16))


class UnsupportedVersionError(RuntimeError):
    """A private Keras/TensorFlow name tnt relies on is missing in this version."""


def _keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


def _missing(what: str, err: Exception) -> UnsupportedVersionError:
    low, high = TESTED_KERAS
    return UnsupportedVersionError(
        f"tarantella needs {what}, which this Keras {keras.__version__} / TensorFlow "
        f"{tf.__version__} does not provide ({err}). tnt-keras is tested with Keras "
        f"{low[0]}.{low[1]} up to (not including) {high[0]}.{high[1]}: install a Keras "
        f"in that range (pip install 'keras>={low[0]}.{low[1]},<{high[0]}.{high[1]}')."
    )


def loss_tracker(model: keras.Model) -> keras.metrics.Metric:
    """The ``Mean`` metric behind the ``loss`` entry of the default step's logs."""
    try:
        return model._loss_tracker
    except AttributeError as err:
        raise _missing("keras.Model._loss_tracker", err) from err


def compile_arguments(model: keras.Model) -> dict[str, Any]:
    """The arguments ``keras.Model.compile`` last received on ``model`` (the objects
    themselves, not their configs: the user's optimizer stays the user's)."""
    try:
        return dict(model._compile_config.config)
    except AttributeError as err:
        raise _missing("keras.Model._compile_config", err) from err


def optimizer_variables_built_on(optimizer: keras.optimizers.Optimizer) -> list:
    """The trainable variables an optimizer was built with (``apply(grads)`` without them)."""
    if not optimizer.built:
        return []
    try:
        return list(optimizer._trainable_variables)
    except AttributeError as err:
        raise _missing("Optimizer._trainable_variables", err) from err


def float16_differentiated(model: keras.Model) -> set[int]:
    """ids of the trainable variables whose layer reads them cast to float16 (Keras'
    autocast under a float16 compute dtype): serial Keras' gradient of each is a float16
    value. Uses Layer._flatten_layers, Layer._trainable_variables and Variable._autocast."""
    try:
        out = set()
        for layer in model._flatten_layers(include_self=True, recursive=True):
            if not layer.autocast or keras.backend.standardize_dtype(layer.compute_dtype) != "float16":
                continue
            for v in layer._trainable_variables:
                if v._autocast and keras.backend.standardize_dtype(v.dtype) == "float32":
                    out.add(id(v))
        return out
    except AttributeError as err:
        raise _missing("which variables a layer autocasts to float16", err) from err


def has_compiled_loss(model: keras.Model) -> bool:
    """True when ``compile`` gave the model a loss (``compute_loss`` then needs targets)."""
    return getattr(model, "_compile_loss", None) is not None


def flatten_logs(model: keras.Model, logs: dict):
    """Logs as ``train_on_batch``/``test_on_batch`` return them without ``return_dict``.

    Keras' order: the model's metrics by name, then the remaining keys sorted; one value
    alone is returned as a scalar.
    """
    names = [m.name for m in model.metrics]
    results = [logs[n] for n in names if n in logs]
    results += [logs[k] for k in sorted(logs) if k not in names]
    return results[0] if len(results) == 1 else results


def batch_norm_reduction_axes(layer: keras.layers.BatchNormalization) -> list[int]:
    """The axes a BatchNormalization layer reduces over (set when it is built).

    ``SyncBatchNormalization`` also overrides the layer's private ``_moments`` hook, the
    one place Keras computes batch statistics; tests/test_keras_api checks it still is.
    """
    try:
        return list(layer._reduction_axes)
    except AttributeError as err:
        raise _missing("BatchNormalization._reduction_axes", err) from err


def is_cached_eval_call(kwargs: dict[str, Any]) -> bool:
    """True when Keras' fit calls evaluate() for validation (data already prepared)."""
    return bool(kwargs.get("_use_cached_eval_dataset"))


@contextlib.contextmanager
def temporary_global_seed(seed: int):
    """TensorFlow's global seed set to ``seed`` inside, and unset again afterwards (only
    for code that runs while no global seed is set)."""
    tf.random.set_seed(seed)
    try:
        yield
    finally:
        tf.random.set_seed(None)


def global_seed() -> int | None:
    """TensorFlow's global seed (``tf.random.set_seed``), or None when none is set."""
    try:
        from tensorflow.python.eager import context
    except ImportError as err:  # pragma: no cover - TensorFlow moved it
        raise _missing("tensorflow.python.eager.context", err) from err
    seed = context.global_seed()
    return None if seed is None else int(seed)


def keras_array_dataset(x, y, sample_weight, batch_size: int, shuffle: bool) -> tf.data.Dataset:
    """The global batches plain ``keras.Model.fit(x, y, batch_size, shuffle)`` iterates.

    Built by Keras' own array adapter, so that under the same seed the sample order is the
    one a serial script sees (its permutation comes from an op-seeded ``tf.random.shuffle``).
    """
    try:
        from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter
    except ImportError as err:
        raise _missing("keras.src.trainers.data_adapters.ArrayDataAdapter", err) from err
    adapter = ArrayDataAdapter(x, y, sample_weight=sample_weight, batch_size=batch_size,
                               shuffle=shuffle)
    # Keras passes the step count to its loop; a dataset carries it as its cardinality
    # (unknown otherwise, and Keras' loop then ends epochs on OutOfRange).
    return adapter.get_tf_dataset().apply(tf.data.experimental.assert_cardinality(adapter.num_batches))


def backup_paths(callback: keras.callbacks.BackupAndRestore) -> tuple[str, str]:
    """(weights file, training metadata file) of a BackupAndRestore callback."""
    try:
        return callback._weights_path, callback._training_metadata_path
    except AttributeError as err:
        raise _missing("BackupAndRestore._weights_path/_training_metadata_path", err) from err


def uninitialized_pending() -> list:
    """Keras' list of variables made in a ``StatelessScope`` and not yet initialised."""
    try:
        from keras.src.backend.common import global_state
    except ImportError as err:  # pragma: no cover - Keras moved it
        raise _missing("keras.src.backend.common.global_state", err) from err
    return global_state.get_global_attribute("uninitialized_variables", [], set_to_default=True)


def initialize_deferred(variable) -> None:
    """Give a variable made in a ``StatelessScope`` its initial value now."""
    variable._deferred_initialize()


def forget_uninitialized(variables) -> None:
    """Take ``variables`` off Keras' list of variables to initialise when a scope ends.

    Keras initialises every variable created in a ``StatelessScope`` at the end of the next
    outermost ``StatelessScope`` (which its TensorFlow backend opens for every symbolic
    call): a deferred model would then be materialised by the first stage built.
    """
    pending = uninitialized_pending()
    ours = {id(v) for v in variables}
    pending[:] = [v for v in pending if id(v) not in ours]


@contextlib.contextmanager
def optimizers_made_with_values():
    """Within a ``StatelessScope``, let Keras optimizers be made (with their step counter).

    Keras makes an optimizer's ``iterations`` from a value (0), which a stateless scope
    refuses; a model whose constructor compiles itself (keras-hub's ``Task`` does, with a
    fresh Adam) can then not be built or loaded inside :func:`deferred_variables`. An
    optimizer's own variables are a few scalars, so it is made outside the scope.
    """
    try:
        from keras.src.backend.common import global_state
        from keras.src.optimizers.base_optimizer import BaseOptimizer
    except ImportError as err:  # pragma: no cover - Keras moved them
        raise _missing("keras.src.optimizers.base_optimizer.BaseOptimizer", err) from err
    original = BaseOptimizer.__init__

    def init(self, *args, **kwargs):
        scope = global_state.get_global_attribute("stateless_scope")
        global_state.set_global_attribute("stateless_scope", None)
        try:
            original(self, *args, **kwargs)
        finally:
            global_state.set_global_attribute("stateless_scope", scope)

    BaseOptimizer.__init__ = init
    try:
        yield
    finally:
        BaseOptimizer.__init__ = original


def is_uninitialized(variable) -> bool:
    """True for a variable created in a ``StatelessScope`` whose value was never made."""
    return getattr(variable, "_value", True) is None and getattr(variable, "_initializer", None) is not None


def initial_value(variable):
    """The value a deferred variable would get when initialised (its initializer's)."""
    return variable._initializer(variable.shape, dtype=variable.dtype)


def model_from_saved_config(config_json: str, custom_objects, compile: bool, safe_mode: bool):
    """The model of a ``.keras`` file's config.json, compiled as ``load_model`` compiles it."""
    try:
        from keras.src.saving import saving_lib
    except ImportError as err:  # pragma: no cover - Keras moved it
        raise _missing("keras.src.saving.saving_lib", err) from err
    return saving_lib._model_from_config(config_json, custom_objects, compile, safe_mode)


def all_sublayers(model: keras.Model) -> list:
    """Every layer inside ``model``, nested models' and layers' own sublayers included, each
    once, parents before their children (Layer._flatten_layers)."""
    try:
        return list(model._flatten_layers(include_self=False, recursive=True))
    except AttributeError as err:  # pragma: no cover
        raise _missing("Layer._flatten_layers", err) from err


def saved_layer_paths(model: keras.Model, prefix: str = "") -> dict[str, str]:
    """Layer name -> the group holding its variables in a file Keras saved of ``model``.

    Keras names a layer's group after its class (``layers/dense_2``), not its name,
    numbering repeats in ``model.layers`` order; a nested model's layers sit in its group
    (``layers/gpt2_backbone/layers/reversible_embedding``), and a layer reached twice is
    saved where Keras' depth-first walk meets it first.
    """
    try:
        from keras.src.utils import naming
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.utils.naming", err) from err
    used: dict[str, int] = {}
    out: dict[str, str] = {}
    for layer in model.layers:
        name = naming.to_snake_case(layer.__class__.__name__)
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        if layer.name in out:
            continue
        out[layer.name] = f"{prefix}layers/{name}"
        if isinstance(layer, keras.Model):
            for inner, path in saved_layer_paths(layer, f"{prefix}layers/{name}/").items():
                out.setdefault(inner, path)
    return out


def weights_store(path: str, archive=None):
    """Keras' reader of a weights file (``archive``: the open .keras zip holding it)."""
    try:
        from keras.src.saving import saving_lib
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib", err) from err
    return saving_lib.H5IOStore(path, archive=archive, mode="r")


def load_layer_state(layer, store, inner_path: str) -> None:
    """Load ``layer`` (and the layers inside it) from ``inner_path`` of ``store`` only."""
    try:
        from keras.src.saving import saving_lib
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib._load_state", err) from err
    saving_lib._load_state(layer, store, None, inner_path, visited_saveables=set())


def saved_variable_locations(layer, inner_path: str) -> dict[int, tuple[str, str]]:
    """id(variable) -> (group, key) under which Keras writes each of ``layer``'s variables
    (its sub-layers' too) when ``layer`` sits at ``inner_path`` of a saved model.

    Keras' own save walk runs against a store that only records: nothing is read or written.
    """
    try:
        from keras.src.saving import saving_lib
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib._save_state", err) from err

    class _Recorder(saving_lib.H5IOStore):
        def __init__(self) -> None:  # no file
            self.found: dict[int, tuple[str, str]] = {}
            self.path = ""

        def __bool__(self) -> bool:
            return True

        def make(self, path, metadata=None):
            self.path = path
            return self

        def __setitem__(self, key, value) -> None:
            self.found[id(value)] = (self.path, str(key))

    recorder = _Recorder()
    saving_lib._save_state(layer, recorder, None, inner_path, visited_saveables=set())
    return recorder.found


def _saving_lib():
    try:
        from keras.src.saving import saving_lib
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib", err) from err
    return saving_lib


def recorded_save_walk(saveable, inner_path: str = "", skip: tuple = ()) -> list[tuple]:
    """What Keras' own save walk of ``saveable`` does to its weights store, in order:
    ``("make", group, metadata)`` and ``("set", key, value)`` (the object handed to the
    store: a layer's variable, an optimizer's numpy value). Nothing is read or written;
    ``skip``: saveables left out (with what they hold)."""
    saving_lib = _saving_lib()

    class _Recorder(saving_lib.H5IOStore):
        def __init__(self) -> None:  # no file
            self.events: list[tuple] = []

        def __bool__(self) -> bool:
            return True

        def make(self, path, metadata=None):
            self.events.append(("make", path, metadata))
            return self

        def __setitem__(self, key, value) -> None:
            self.events.append(("set", str(key), value))

    recorder = _Recorder()
    try:
        saving_lib._save_state(saveable, recorder, None, inner_path, visited_saveables={id(s) for s in skip})
    except AttributeError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib._save_state", err) from err
    return recorder.events


def h5_writer(path: str):
    """Keras' writer of a weights file at ``path``: h5py writes each dataset to disk as it
    is set, and a numpy array is written from its own memory (Keras' store copies every
    value through ``convert_to_numpy`` first: one more array in memory)."""
    import numpy as np

    saving_lib = _saving_lib()

    class _Writer(saving_lib.H5IOStore):
        def __setitem__(self, key, value) -> None:
            if not isinstance(value, np.ndarray) or keras.backend.standardize_dtype(value.dtype) == "bfloat16":
                super().__setitem__(key, value)
                return
            try:
                if not self._h5_entry_initialized:
                    self._create_h5_group(self._h5_entry_path)
                self._h5_entry_group[key] = value
            except AttributeError as err:  # pragma: no cover
                raise _missing("H5IOStore._h5_entry_group/_create_h5_group", err) from err

    return _Writer(path, mode="w")


def model_file_json(model: keras.Model) -> tuple[str, str]:
    """(config.json, metadata.json) of a ``.keras`` file of ``model``, as Keras writes them
    (the configuration only: no variable is read)."""
    try:
        return _saving_lib()._serialize_model_as_json(model)
    except AttributeError as err:  # pragma: no cover
        raise _missing("keras.src.saving.saving_lib._serialize_model_as_json", err) from err


def has_assets(model: keras.Model) -> bool:
    """Whether a layer of ``model`` saves assets (a lookup's vocabulary) besides variables."""
    return any(hasattr(layer, "save_assets") for layer in [model, *all_sublayers(model)])


def h5_dataset(store, group: str, key: str):
    """The h5py dataset ``key`` of ``group`` in a store opened by :func:`weights_store`,
    unread (slicing it reads only that part), or None when the file has none."""
    vars_path = f"{group}/vars" if group else "vars"
    root = store.h5_file
    if vars_path not in root or key not in root[vars_path]:
        return None
    return root[vars_path][key]


def version_warning() -> str | None:
    """A warning text when this Keras is outside the tested range, else None."""
    low, high = TESTED_KERAS
    if low <= _keras_version() < high:
        return None
    return (f"Keras {keras.__version__} is outside the range tnt-keras is tested with "
            f"({low[0]}.{low[1]} to before {high[0]}.{high[1]}); if a step fails with "
            "UnsupportedVersionError, install a Keras in that range.")


def ask_to_overwrite(path: str) -> bool:
    """Keras' own terminal question before overwriting a file (``save(overwrite=False)``)."""
    from keras.src.utils import io_utils

    return bool(io_utils.ask_to_proceed_with_overwrite(path))


def all_layers(layer) -> list:
    """Every layer nested in ``layer`` (Keras' ``layers`` lists only the top level)."""
    out = []
    for sub in getattr(layer, "layers", []):
        out.append(sub)
        out.extend(all_layers(sub))
    return out


def functional_structure(functional: keras.Model) -> tuple:
    """(input structure, output structure, nodes by depth, input layer names) of a
    functional model: what walking its graph needs (Functional._inputs_struct,
    _outputs_struct, _nodes_by_depth and KerasTensor._keras_history)."""
    try:
        inputs = functional._inputs_struct
        names = [t._keras_history[0].name for t in keras.tree.flatten(inputs)]
        return inputs, functional._outputs_struct, functional._nodes_by_depth, names
    except AttributeError as err:
        raise _missing("the functional model's graph (Functional._nodes_by_depth)", err) from err


def get_keras_mask(x):
    """The Keras mask a tensor carries (None without one)."""
    from keras.src.backend.common import masking

    return masking.get_keras_mask(x)


def set_keras_mask(x, mask) -> None:
    """Attach ``mask`` to ``x`` as Keras does for a masking layer's output."""
    from keras.src.backend.common import masking

    masking.set_keras_mask(x, mask)


def call_output_specs(model: keras.Model):
    """The structure of KerasTensors ``model(x)`` returns, for a built functional or
    Sequential model whose ``call`` is Keras' own; None where only a forward pass can tell
    (a subclassed model, a Sequential without an Input). Lets variables be built without
    running the model (sync.build_variables)."""
    from keras.src.models.functional import Functional, unpack_singleton

    if isinstance(model, keras.Sequential):
        if type(model).call is not keras.Sequential.call or getattr(model, "_functional", None) is None:
            return None
        model = model._functional
    if not isinstance(model, Functional) or type(model).call is not Functional.call:
        return None
    try:
        return unpack_singleton(model._outputs_struct)
    except AttributeError:
        return None


def in_symbolic_scope() -> bool:
    """True inside Keras' shape inference (``compute_output_spec``: no values are computed)."""
    try:
        from keras.src.backend.common.symbolic_scope import in_symbolic_scope as inside
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.backend.common.symbolic_scope", err) from err
    return bool(inside())


def own_trainable_variables(layer) -> list:
    """The trainable variables ``layer`` created itself (not its sublayers'), if it is trainable
    (Layer._trainable_variables)."""
    if not layer.trainable:
        return []
    try:
        return [v for v in layer._trainable_variables if v.trainable]
    except AttributeError as err:  # pragma: no cover
        raise _missing("Layer._trainable_variables", err) from err


def drop_value(variable, initializer) -> None:
    """Free ``variable``'s value: it then reads as a variable made in a ``StatelessScope``
    does (KerasVariable._value = None), through ``initializer`` (sharding level 3)."""
    variable._value = None
    variable._initializer = initializer


def restore_value(variable, value) -> None:
    """Give a variable freed by :func:`drop_value` a value again (eagerly)."""
    variable._initializer = None
    with tf.init_scope():
        variable._initialize(value)


def park_value(variable, initializer):
    """Free ``variable``'s memory but keep its backing ``tf.Variable`` (returned): its buffer
    shrinks to 0 elements, so traced functions that captured its handle stay valid for
    :func:`unpark_value`; meanwhile eager reads go through ``initializer`` as after
    :func:`drop_value` (sharding level 3 of pipeline stages)."""
    backing = variable._value
    tf.raw_ops.AssignVariableOp(resource=backing.handle, value=tf.zeros([0], backing.dtype), validate_shape=False)
    variable._value = None
    variable._initializer = initializer
    return backing


def unpark_value(variable, backing, value) -> None:
    """Give a variable parked by :func:`park_value` its whole ``value`` again, in the same
    backing ``tf.Variable`` (the handle traced functions captured)."""
    tf.raw_ops.AssignVariableOp(resource=backing.handle, value=tf.convert_to_tensor(value, backing.dtype),
                                validate_shape=False)
    variable._initializer = None
    variable._value = backing


def without_autocast():
    """A scope in which Keras variables read as stored (no mixed-precision cast): level 3
    gathers the owned float32 values, which each layer call then casts as Keras would."""
    try:
        from keras.src.backend import AutocastScope
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.backend.AutocastScope", err) from err
    return AutocastScope(None)


def autocast_dtype() -> str | None:
    """The dtype Keras' current autocast scope casts float variables to (a mixed-precision
    layer's ``__call__`` enters one), None without a cast: level 3 recomputes a layer's call
    in backprop, outside that ``__call__``, and must cast its weights alike."""
    try:
        from keras.src.backend import get_autocast_scope
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.backend.get_autocast_scope", err) from err
    scope = get_autocast_scope()
    return None if scope is None else scope.dtype


def autocast_to(dtype: str | None):
    """A scope in which float Keras variables read cast to ``dtype`` (None: as stored)."""
    try:
        from keras.src.backend import AutocastScope
    except ImportError as err:  # pragma: no cover
        raise _missing("keras.src.backend.AutocastScope", err) from err
    return AutocastScope(dtype)
