"""The strategy interface: each strategy declares its options once and how it builds and
loads a model; ``tnt.Model(...)`` and ``tnt.models.load_model(...)`` resolve it here.

A strategy registers itself when its subpackage is imported (``tarantella/__init__``
imports them all), so this module imports none of them: the registry is the only place
the strategies meet. Resolution is one lookup, never a trial of each strategy in turn.
An option of another strategy, or a name no strategy takes, is one error naming them
(the error class of the strategy that owns the option, else of the chosen one).

Every strategy may answer "nothing to distribute but data": on one rank, with one
pipeline stage, or with ``tensor_parallel_size=1``, its ``build``/``load`` return None and
the caller makes the data-parallel wrapper instead (docs/architecture.md, "Strategies").
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import keras


class ParallelStrategy(enum.Enum):
    """How the model is parallelised: DATA, PIPELINING (N == p stages), ALL (N/p pipelines),
    TENSOR (layers split over N == t ranks, see docs/tensor_parallel.md), AUTO (the planner
    chooses one of them within a memory budget, see docs/auto.md)."""

    DATA = "data"
    PIPELINING = "pipelining"
    ALL = "all"
    TENSOR = "tensor"
    AUTO = "auto"


#: build(model, parallel_strategy, options) -> the distributed model, or None for the
#: data-parallel wrapper of ``model``.
Build = Callable[[keras.Model, ParallelStrategy, dict], "keras.Model | None"]
#: load(filepath, parallel_strategy, options, custom_objects=, compile=, **keras_kwargs)
#: -> the distributed model, or None: load the file data-parallel.
Load = Callable[..., "keras.Model | None"]


@dataclass(frozen=True)
class Strategy:
    """One way of distributing a model: the options it takes and how it builds and loads."""

    name: str
    handles: tuple[ParallelStrategy, ...]
    options: tuple[str, ...]
    error: type[Exception]
    build: Build
    load: Load


_REGISTRY: dict[ParallelStrategy, Strategy] = {}
_OWNERS: dict[str, Strategy] = {}


def register(strategy: Strategy) -> None:
    """Make ``strategy`` the one that builds and loads its ``handles`` (import time)."""
    for member in strategy.handles:
        _REGISTRY[member] = strategy
    for option in strategy.options:
        _OWNERS.setdefault(option, strategy)


def parse(parallel_strategy: Any) -> ParallelStrategy:
    """``parallel_strategy`` as the enum (its value strings accepted), or a ValueError naming
    the choices."""
    if isinstance(parallel_strategy, ParallelStrategy):
        return parallel_strategy
    try:
        return ParallelStrategy(parallel_strategy)
    except ValueError:
        choices = ", ".join(f"ParallelStrategy.{m.name}" for m in ParallelStrategy)
        raise ValueError(f"parallel_strategy={parallel_strategy!r} is not a strategy; use one of {choices}."
                         ) from None


def strategy_for(parallel_strategy: Any) -> Strategy:
    """The registered strategy of ``parallel_strategy``."""
    member = parse(parallel_strategy)
    try:
        return _REGISTRY[member]
    except KeyError:  # pragma: no cover - tarantella/__init__ registers every member
        raise RuntimeError(f"no strategy is registered for {member}; import tarantella first.") from None


def split_options(parallel_strategy: Any, kwargs: Mapping[str, Any], *,
                  where: str) -> tuple[ParallelStrategy, Strategy, dict, dict]:
    """(strategy enum, strategy, its options, the other keyword arguments) of ``kwargs``.

    An option that belongs to another strategy raises its owner's error, naming the
    strategies that take it; names that are no strategy's option are left to the caller
    (Keras' own keyword arguments).
    """
    member = parse(parallel_strategy)
    strategy = strategy_for(member)
    options = {k: v for k, v in kwargs.items() if k in strategy.options}
    foreign = [k for k in kwargs if k not in strategy.options and k in _OWNERS]
    if foreign:
        owner = _OWNERS[foreign[0]]
        handled = [m for m in ParallelStrategy if m in _REGISTRY and foreign[0] in _REGISTRY[m].options]
        takes = " or ".join(f"ParallelStrategy.{m.name}" for m in handled)
        raise owner.error(f"{where}(parallel_strategy={member.name}): {', '.join(foreign)} only apply to {takes}; "
                          f"pass parallel_strategy=tnt.ParallelStrategy.{owner.handles[0].name}"
                          f"{' (or ALL)' if ParallelStrategy.ALL in handled else ''} or drop the option(s).")
    rest = {k: v for k, v in kwargs.items() if k not in strategy.options}
    return member, strategy, options, rest


def unknown_options_error(strategy: Strategy, member: ParallelStrategy, unknown: list[str], *,
                          where: str, also: str = "") -> Exception:
    """The one error for keyword arguments no strategy (and not Keras) takes."""
    taken = ", ".join(f"{o}=" for o in strategy.options) or "no options of its own"
    return strategy.error(
        f"{where}(parallel_strategy={member.name}) got unknown keyword argument(s): {', '.join(sorted(unknown))}. "
        f"It takes the Keras model and {taken}{also}.")
