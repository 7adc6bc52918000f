"""What `tessera bench train` compares: ``--strategies`` parsed into one run config per method.

A list item is ``NAME[:KEY=VALUE,KEY=VALUE...]``; items are separated by commas (a ``KEY=VALUE``
without a colon belongs to the item before it) or given as separate arguments::

    ddp,diloco:outer=sgd,alpha=1,dtype=fp32,sparseloco:k=128,alpha=1.6

Names: ``ddp`` (every-step all-reduce, bench only) and every strategy of `node.strategy`.
Keys, each mapped onto the run config of that method (the others keep the preset's values):

============  ===================================  ==================================
key           run config field                     for
============  ===================================  ==================================
lr            optimizer.lr (min_lr = lr / 10)      all
warmup        optimizer.warmup_steps               all
alpha         outer.alpha                          sparseloco, diloco
outer         outer.optimizer (sgd | nesterov)     sparseloco, diloco
momentum      outer.momentum                       sparseloco, diloco
delay         outer.delay (0 | 1)                  sparseloco, diloco
land          with delay 1: share of a window's inner  sparseloco, diloco
              steps trained before the previous
              window's step lands (default 0.1)
k             codec.k                              sparseloco
beta          outer.beta                           sparseloco
freeze        outer.ef_freeze_fraction             sparseloco
values        2bit | fp32 (fp32: bench ablation)   sparseloco
dtype         dense.dtype (bf16 | fp32)            diloco
label         the name shown in the table          all
============  ===================================  ==================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocol.runconfig import RunConfig, RunConfigError

DEFAULT_STRATEGIES = (
    "ddp,"
    "diloco:outer=sgd,alpha=1,dtype=fp32,label=dense local SGD,"
    "diloco:outer=nesterov,alpha=0.7,momentum=0.9,dtype=bf16,label=DiLoCo,"
    "sparseloco"
)
DEFAULT_LAND = 0.1
"""Share of a window trained before the previous window's exchange lands: the presets' exchange
takes 7-11 % of their windows (`tessera plan`)."""
QUICK_STRATEGIES = "ddp,diloco:outer=sgd,alpha=1,dtype=fp32,sparseloco"

_COMMON = {"lr", "warmup", "label"}
_LOCAL = _COMMON | {"alpha", "outer", "momentum", "delay", "land"}
KEYS: dict[str, set[str]] = {
    "ddp": _COMMON,
    "diloco": _LOCAL | {"dtype"},
    "sparseloco": _LOCAL | {"k", "beta", "freeze", "values"},
}


class SpecError(ValueError):
    """A ``--strategies`` item is malformed (unknown name or key, bad value)."""


@dataclass(frozen=True)
class MethodSpec:
    """One method of the comparison: its strategy name, label, options and run config."""

    strategy: str
    label: str
    options: dict[str, str]
    run: RunConfig
    exact_values: bool = False  # sparseloco with float32 values (bench ablation)
    land: float = DEFAULT_LAND  # with outer.delay = 1 (`deploy.bench_train.engine.landing_step`)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def dense(self) -> bool:
        return self.strategy in ("ddp", "diloco")


def split_items(text: str | list[str]) -> list[str]:
    """``NAME[:K=V,...]`` items from comma-separated text (or several arguments)."""
    parts = text if isinstance(text, list) else [text]
    tokens = [tok.strip() for part in parts for tok in part.split(",") if tok.strip()]
    items: list[str] = []
    for tok in tokens:
        if "=" in tok and ":" not in tok.split("=", 1)[0]:
            if not items:
                raise SpecError(f"{tok!r} comes before any strategy name")
            sep = "," if ":" in items[-1] else ":"
            items[-1] += sep + tok
        else:
            items.append(tok)
    return items


def _options(item: str) -> tuple[str, dict[str, str]]:
    name, _, rest = item.partition(":")
    name = name.strip()
    if name not in KEYS:
        raise SpecError(f"unknown strategy {name!r}; known: {', '.join(KEYS)}")
    options: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or key not in KEYS[name]:
            raise SpecError(
                f"{name}: unknown option {pair!r}; known: {', '.join(sorted(KEYS[name]))}"
            )
        options[key] = value.strip()
    return name, options


def _overrides(name: str, o: dict[str, str]) -> dict[str, Any]:
    over: dict[str, Any] = {"strategy": "diloco" if name == "ddp" else name}
    opt: dict[str, Any] = {}
    outer: dict[str, Any] = {}
    if "lr" in o:
        opt["lr"] = float(o["lr"])
        opt["min_lr"] = float(o["lr"]) / 10
    if "warmup" in o:
        opt["warmup_steps"] = int(o["warmup"])
    for key, target, kind in (
        ("alpha", "alpha", float),
        ("beta", "beta", float),
        ("momentum", "momentum", float),
        ("freeze", "ef_freeze_fraction", float),
        ("outer", "optimizer", str),
    ):
        if key in o:
            outer[target] = kind(o[key])
    if "delay" in o:
        outer["delay"] = int(o["delay"])
    if "k" in o:
        over["codec"] = {"k": int(o["k"])}
    if "dtype" in o:
        over["dense"] = {"dtype": o["dtype"]}
    if opt:
        over["optimizer"] = opt
    if outer:
        over["outer"] = outer
    return over


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_methods(text: str | list[str], base: RunConfig) -> list[MethodSpec]:
    """Every method of ``text`` as a `MethodSpec` built on ``base`` (`SpecError` if malformed)."""
    methods = []
    for item in split_items(text):
        name, options = _options(item)
        if options.get("values", "2bit") not in ("2bit", "fp32"):
            raise SpecError(f"{name}: values must be 2bit or fp32")
        land = _fraction(item, options.get("land", str(DEFAULT_LAND)))
        try:
            over = _overrides(name, options)
            run = RunConfig.from_dict(_merge(base.model_dump(mode="json"), over))
        except (ValueError, RunConfigError) as exc:
            raise SpecError(f"{item}: {exc}") from exc
        label = options.get("label") or _label(name, options)
        methods.append(
            MethodSpec(
                name, label, options, run, exact_values=options.get("values") == "fp32", land=land
            )
        )
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):
        raise SpecError(f"two methods share a label: {labels} (give each a label=...)")
    return methods


def _label(name: str, options: dict[str, str]) -> str:
    shown = {k: v for k, v in options.items() if k != "label"}
    return name + (" " + " ".join(f"{k}={v}" for k, v in shown.items()) if shown else "")


def _fraction(item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{item}: land must be a number in [0, 1]") from None
    if not 0 <= value <= 1:
        raise SpecError(f"{item}: land must be a number in [0, 1]")
    return value
