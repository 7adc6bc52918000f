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
inner         optimizer.name (adamw | sgd)         all
alpha         outer.alpha                          every local method
peak          outer.alpha_at_peak (none: unset)    every local method
outer         outer.optimizer (sgd | nesterov)     every local method
momentum      outer.momentum                       every local method
delay         outer.delay (0 | 1)                  every local method
land          with delay 1: share of the inner     every local method
              steps trained before the previous
              step lands (default 0.1)
h             inner steps per outer step (below)   every local method
k             codec.k                              every sparse method (greedylore: fallback)
bits          codec.value_bits (2 | 1)             every sparse method
beta          outer.beta                           every sparse method
freeze        outer.ef_freeze_fraction             every sparse method
values        2bit | fp32 (fp32: bench ablation)   sparseloco
shared        mask.shared_k                        sparseloco-mask
fresh         mask.fresh_k                         sparseloco-mask
explore       mask.explore                         sparseloco-mask
rank          lowrank.rank                         greedylore
tau           lowrank.tau                          greedylore
select        lagged | now (now: bench only)       greedylore
basis         greedy | random (random: bench only) greedylore
dtype         dense.dtype (bf16 | fp32)            diloco, greedylore
label         the name shown in the table          all
family        the baseline family it tunes (its    all
              best configuration is the one
              every ratio is taken against)
============  ===================================  ==================================

``h`` must divide the run's H: the method then takes H / h outer steps per bench window, each
after h inner steps on the same batches the others see in that window (``demo:h=1`` is DeMo's
own setting, one synchronisation per optimizer step), so every method sees the same tokens per
window; its bytes per window are the sum over those steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from codec.errors import TesseraError
from node.strategy.outer import LAND_BY
from protocol.runconfig import RunConfig, RunConfigError

DEFAULT_STRATEGIES = (
    "ddp,"
    "diloco:outer=sgd,alpha=1,dtype=fp32,label=dense local SGD,"
    "diloco:outer=nesterov,alpha=0.3,momentum=0.9,dtype=bf16,label=DiLoCo,"
    "sparseloco"
)
QUICK_STRATEGIES = "ddp,diloco:outer=sgd,alpha=1,dtype=fp32,sparseloco"

_COMMON = {"lr", "warmup", "inner", "label", "family"}
_LOCAL = _COMMON | {"alpha", "peak", "outer", "momentum", "delay", "land", "h"}
_SPARSE = _LOCAL | {"k", "bits", "beta", "freeze"}
KEYS: dict[str, set[str]] = {
    "ddp": _COMMON,
    "diloco": _LOCAL | {"dtype"},
    "sparseloco": _SPARSE | {"values"},
    "demo": _SPARSE,
    "sparseloco-mask": (_SPARSE - {"k"}) | {"shared", "fresh", "explore"},
    "greedylore": _SPARSE | {"rank", "tau", "select", "basis", "dtype"},
}
CHOICES = {"values": ("2bit", "fp32"), "select": ("lagged", "now"), "basis": ("greedy", "random")}


class SpecError(TesseraError, ValueError):
    """A ``--strategies`` item is malformed (unknown name or key, bad value)."""


@dataclass(frozen=True)
class MethodSpec:
    """One method of the comparison: its strategy name, label, options and run config."""

    strategy: str
    label: str
    options: dict[str, str]
    run: RunConfig
    exact_values: bool = False  # sparseloco with float32 values (bench ablation)
    land: float = LAND_BY  # with outer.delay = 1 (`node.strategy.outer.land_by_step`)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def dense(self) -> bool:
        return self.strategy in ("ddp", "diloco")

    @property
    def family(self) -> str:
        """The baseline family this configuration belongs to (itself when it names none)."""
        return self.options.get("family") or self.label


DDP_LR_FACTORS = (0.5, 1.0, 1.5, 2.0)
DENSE_GRID = ((0.7, 1.0), (1.0, 1.0), (1.4, 1.0), (1.0, 1.5), (1.0, 2.0))  # (alpha, lr factor)
DILOCO_GRID = ((0.3, 0.7), (0.3, 0.9), (0.7, 0.7), (0.7, 0.9))  # (alpha, momentum)


def tuned_strategies(base: RunConfig, methods: str | list[str] = "sparseloco") -> str:
    """``--tune``: every baseline over a grid, each configuration tagged with its family, then
    `methods` (``--strategies``; SparseLoCo at the run's settings by default): DDP over four
    learning rates (its batch is R times a replica's), dense local SGD over three outer learning
    rates and, at plain averaging, two higher inner ones (local training can take a higher inner
    rate than the run's), DiLoCo over two outer learning rates and two momenta, each at a
    constant outer rate (``peak=none``)."""
    lr = base.optimizer.lr
    items = [f"ddp:lr={lr * f:.3g},family=DDP,label=DDP lr {lr * f:.3g}" for f in DDP_LR_FACTORS]
    items += [
        f"diloco:outer=sgd,alpha={a},lr={lr * f:.3g},peak=none,dtype=fp32,"
        f"family=dense local SGD,label=dense local SGD alpha {a}"
        + ("" if f == 1.0 else f" lr {lr * f:.3g}")
        for a, f in DENSE_GRID
    ]
    items += [
        f"diloco:outer=nesterov,alpha={a},momentum={m},peak=none,dtype=bf16,family=DiLoCo,"
        f"label=DiLoCo alpha {a} momentum {m}"
        for a, m in DILOCO_GRID
    ]
    return ",".join([*items, *split_items(methods)])


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
    if "inner" in o:
        opt["name"] = o["inner"]
    for key, target, kind in (
        ("alpha", "alpha", float),
        ("beta", "beta", float),
        ("momentum", "momentum", float),
        ("freeze", "ef_freeze_fraction", float),
        ("outer", "optimizer", str),
        ("delay", "delay", int),
    ):
        if key in o:
            outer[target] = kind(o[key])
    if "peak" in o:
        outer["alpha_at_peak"] = None if o["peak"] == "none" else float(o["peak"])
    codec = {key: int(o[src]) for src, key in (("k", "k"), ("bits", "value_bits")) if src in o}
    if codec:
        over["codec"] = codec
    if "dtype" in o:
        over["dense"] = {"dtype": o["dtype"]}
    mask = {key: kind(o[src]) for src, key, kind in
            (("shared", "shared_k", int), ("fresh", "fresh_k", int), ("explore", "explore", float))
            if src in o}  # fmt: skip
    if mask:
        over["mask"] = mask
    lowrank = {key: int(o[key]) for key in ("rank", "tau") if key in o}
    if lowrank:
        over["lowrank"] = lowrank
    if opt:
        over["optimizer"] = opt
    if outer:
        over["outer"] = outer
    return over


def _per_sync(base: RunConfig, options: dict[str, str]) -> dict[str, Any]:
    """The overrides of option ``h``: H = h, and as many more outer steps in the schedule."""
    if "h" not in options:
        return {}
    h = int(options["h"])
    if h < 1 or base.inner_steps % h:
        raise SpecError(f"h={h} must divide the run's {base.inner_steps} inner steps")
    syncs = base.inner_steps // h
    return {"inner_steps": h, "outer": {"total_windows": base.outer.total_windows * syncs}}


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
        for key, allowed in CHOICES.items():
            if options.get(key, allowed[0]) not in allowed:
                raise SpecError(f"{name}: {key} must be one of {', '.join(allowed)}")
        land = _fraction(item, options.get("land", str(LAND_BY)))
        try:
            over = _merge(_overrides(name, options), _per_sync(base, options))
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
    shown = {k: v for k, v in options.items() if k not in ("label", "family")}
    return name + (" " + " ".join(f"{k}={v}" for k, v in shown.items()) if shown else "")


def _fraction(item: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise SpecError(f"{item}: land must be a number in [0, 1]") from None
    if not 0 <= value <= 1:
        raise SpecError(f"{item}: land must be a number in [0, 1]")
    return value
