"""The run configuration: everything every peer and validator of one training run must share.

A `RunConfig` is identified by its **run id**: the BLAKE2b-128 digest (32 hex characters) of the
config's canonical JSON (keys sorted, no whitespace, ASCII only, no NaN/inf), prefixed with a
domain tag. Any change to any field (model shape, optimizer, codec, timing, names) gives a new
run id, so two nodes that print the same run id agree on every byte of the configuration. The id
goes into every object name and every signed message; `require_same_run` turns a mismatch into
one typed error.

Configs load from and dump to TOML or JSON (chosen by file suffix). A dumped file carries its
run id (a comment in TOML, a `run_id` key in JSON); when a loaded file carries one it must match
the recomputed id, so a hand-edited config cannot masquerade as the original run.

Timing convention (see `protocol.windows`): the upload deadline is counted in **blocks after the
window's end**: window `w` covers blocks `[w*B, (w+1)*B)`, and an update for `w` must be stored
before block `(w+1)*B + upload_deadline_blocks`; wall-clock comparisons allow
`clock_skew_tolerance_s` of slack.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from codec.errors import TesseraError
from codec.spec import CODEC_VERSION, CodecParams
from protocol.presets import PRESETS

RUN_ID_HEX_CHARS = 32
"""A run id is 16 bytes (128 bits) of BLAKE2b, written as 32 lowercase hex characters."""

RUN_ID_RE = re.compile(r"[0-9a-f]{32}")

MAX_CONFIG_BYTES = 1 << 20
"""Config files larger than this are refused before parsing."""

_RUN_ID_DOMAIN = b"tessera/run-config/v1\x00"
_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_REF_RE = r"^[\x21-\x7e]{1,512}$"


class RunConfigError(TesseraError, ValueError):
    """A run config file or dict is unreadable, malformed or inconsistent."""


class RunMismatchError(TesseraError, ValueError):
    """Two run ids that should be equal are not (another node, object or file is on another run)."""

    def __init__(self, local_run_id: str, remote_run_id: str, context: str = "") -> None:
        self.local_run_id = local_run_id
        self.remote_run_id = remote_run_id
        where = f" ({context})" if context else ""
        super().__init__(f"run id mismatch{where}: local {local_run_id}, remote {remote_run_id!r}")


def require_same_run(local_run_id: str, remote_run_id: object, context: str = "") -> None:
    """Raise `RunMismatchError` unless `remote_run_id` is exactly the local run id.

    `remote_run_id` is untrusted: anything that is not the identical string (other type, other
    case, padding) is a mismatch.
    """
    if not isinstance(remote_run_id, str) or remote_run_id != local_run_id:
        shown = remote_run_id[:80] if isinstance(remote_run_id, str) else type(remote_run_id)
        raise RunMismatchError(local_run_id, str(shown), context)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ModelConfig(_Frozen):
    """Shape of a LLaMA-style decoder (RMSNorm, RoPE, SwiGLU MLP, grouped-query attention)."""

    vocab_size: int = Field(ge=2, le=1 << 20)
    hidden_size: int = Field(ge=8, le=1 << 16)
    intermediate_size: int = Field(ge=8, le=1 << 18)
    n_layers: int = Field(ge=1, le=1024)
    n_heads: int = Field(ge=1, le=1024)
    n_kv_heads: int = Field(ge=1, le=1024)
    max_seq_len: int = Field(ge=8, le=1 << 20)
    rope_theta: float = Field(gt=0)
    tie_embeddings: bool
    norm_eps: float = Field(gt=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.n_heads:
            raise ValueError("hidden_size must be a multiple of n_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    def param_count(self) -> int:
        """Number of trainable parameters (no biases; RMSNorm weights counted)."""
        d, kv = self.hidden_size, self.n_kv_heads * self.head_dim
        attn = 2 * d * d + 2 * d * kv
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embed + self.n_layers * per_layer + d + head


class InnerOptimizerConfig(_Frozen):
    """The H inner steps' optimizer: AdamW, or plain SGD on raw gradients (``sgd``: lr, schedule
    and clipping apply, betas/eps/weight decay do not); linear warmup, then cosine decay."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, le=1)
    min_lr: float = Field(1e-4, ge=0, le=1)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0, lt=1)
    weight_decay: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(1000, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    schedule: Literal["cosine"] = "cosine"

    @model_validator(mode="after")
    def _check(self) -> InnerOptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError("betas must lie in [0, 1)")
        if self.min_lr > self.lr:
            raise ValueError("min_lr must not exceed lr")
        return self


SUPPORTED_STRATEGIES = ("sparseloco", "demo", "sparseloco-mask")
"""The strategies whose mean clips chunk by chunk and can count each coordinate's support."""


class OuterConfig(_Frozen):
    """The outer step: its optimizer and learning rate; SparseLoCo's error feedback and freeze."""

    optimizer: Literal["sgd", "nesterov"] = Field(
        "sgd",
        description="outer optimizer on the aggregate: plain SGD, or SGD with Nesterov momentum",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="Nesterov momentum (optimizer=nesterov)")
    alpha: float = Field(0.8, gt=0, le=4, description="outer learning rate")
    alpha_at_peak: float | None = Field(
        None,
        gt=0,
        le=4,
        description="outer learning rate of a window trained at the peak inner learning rate: "
        "a window's rate is min(alpha, alpha_at_peak * lr / its steps' mean lr) "
        "(protocol.schedule); none, or alpha or more: alpha in every window",
    )
    beta: float = Field(0.95, ge=0, lt=1, description="error-feedback decay")
    ef_freeze_fraction: float = Field(
        0.05, ge=0, le=1, description="fraction of total_windows with error feedback frozen"
    )
    total_windows: int = Field(ge=1, le=10**9, description="total outer steps of the run")
    delay: int = Field(
        0,
        ge=0,
        le=1,
        description="windows an aggregate waits before it is applied: 1 exchanges window w "
        "while w + 1 trains (docs/training.md)",
    )
    min_support: int = Field(
        1,
        ge=1,
        le=64,
        description="a coordinate of the window's mean moves only where at least this many "
        "applied updates sent it; 2 keeps one update from teaching what no other update moves "
        "(a backdoor's trigger), at a cost to honest training (docs/consensus.md); sparse "
        "strategies only",
    )

    @property
    def ef_freeze_windows(self) -> int:
        """Number of leading windows during which error feedback is frozen."""
        return math.ceil(self.ef_freeze_fraction * self.total_windows)


class DenseConfig(_Frozen):
    """How a dense strategy (`diloco`) puts its pseudo-gradients on the wire."""

    dtype: Literal["bf16", "fp32"] = Field("bf16", description="value type of dense updates")


class MaskConfig(_Frozen):
    """`sparseloco-mask`: per full chunk, the index-free values on the shared support and the
    fresh Top-k sent beside them with indices (together about the bytes of SparseLoCo's k=64)."""

    shared_k: int = Field(
        192, ge=0, le=1 << 20, description="shared values per full chunk (capped at C - fresh_k)"
    )
    fresh_k: int = Field(16, ge=1, le=1 << 20, description="fresh Top-k entries per full chunk")
    explore: float = Field(
        0.25, ge=0, le=1, description="share of the support drawn at random, not from |aggregate|"
    )


class LowRankConfig(_Frozen):
    """`greedylore`: the rank of the projected matrices and the full-matrix period."""

    rank: int = Field(8, ge=1, le=4096, description="r: columns of the shared basis sent a window")
    tau: int = Field(10, ge=1, le=10**6, description="a full-matrix round every tau windows")


class TimingConfig(_Frozen):
    """Window length, upload deadline and clock tolerance (see `protocol.windows`)."""

    block_time_s: float = Field(12.0, gt=0, le=3600, description="nominal seconds per block")
    blocks_per_window: int = Field(ge=1, le=1 << 20)
    upload_deadline_blocks: int = Field(
        ge=0, description="blocks after the window's end by which an update must be stored"
    )
    clock_skew_tolerance_s: float = Field(
        6.0, ge=0, le=600, description="slack when comparing object times with the deadline"
    )
    start_block: int = Field(0, ge=0, description="chain block at which window 0 of the run begins")

    @model_validator(mode="after")
    def _deadline_inside_next_window(self) -> TimingConfig:
        if self.upload_deadline_blocks >= self.blocks_per_window:
            raise ValueError("upload_deadline_blocks must be smaller than blocks_per_window")
        return self


class ConsensusConfig(_Frozen):
    """How a window's exchange is bounded in time and who may join it (see docs/consensus.md)."""

    fetch_budget_s: float = Field(
        60.0, gt=0, le=3600, description="hard wall-clock budget of one gather, from its start"
    )
    min_rate_bytes_s: float = Field(
        256 * 1024, gt=0, description="slowest transfer kept once rate_grace_s has passed"
    )
    rate_grace_s: float = Field(2.0, ge=0, le=600, description="time before the rate is enforced")
    manifest_wait_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="after the fetch budget, how long the lead has to publish its manifest: "
        "the window's cutoff block is the gather block plus fetch_budget_s + manifest_wait_s",
    )
    probation_fraction: float = Field(
        0.25, ge=0, le=1, description="share of the gather slots open to never-scored uids"
    )


class RetentionConfig(_Frozen):
    """How long a node keeps its own objects in its bucket (`node.runtime.retention`).

    Every object of the newest `windows` windows is kept, and so is the newest checkpoint with
    every object since it (what a late joiner replays). Older checkpoints are thinned: the first
    one of each span of `checkpoint_every_kept` windows is kept while it is younger than
    `checkpoint_windows`. Everything else of ours is deleted after each window.
    """

    windows: int = Field(24, ge=2, le=10**6, description="every object of the newest N windows")
    checkpoint_every_kept: int = Field(
        250, ge=1, le=10**9, description="older checkpoints: one kept per span of N windows"
    )
    checkpoint_windows: int = Field(
        1000, ge=0, le=10**9, description="older checkpoints are deleted past this age (windows)"
    )


class RunConfig(_Frozen):
    """Everything all peers of a run must share. Its content hash is the run id."""

    name: str = Field(pattern=_NAME_RE, description="human-readable run name")
    strategy: Literal["sparseloco", "diloco", "demo", "sparseloco-mask", "greedylore"] = Field(
        "sparseloco", description="what peers send and how it is applied (`node.strategy`)"
    )
    preset_name: str = Field(pattern=_NAME_RE, description="model preset the shape came from")
    model: ModelConfig
    tokenizer: str = Field(pattern=_REF_RE)
    dataset: str = Field(pattern=_REF_RE, description="e.g. embedded://tiny-corpus, s3://b/p")
    dataset_digest: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="content digest of the dataset's tokens (`tessera data digest`); peers "
        "refuse a dataset with another one. Unset: not pinned (and not in the run id)",
    )
    seed: int = Field(0, ge=0, lt=1 << 63, description="initial weights and data assignment")
    seq_len: int = Field(ge=8)
    micro_batch_size: int = Field(ge=1, description="sequences per forward/backward pass")
    batch_size: int = Field(ge=1, description="sequences per inner step per peer")
    inner_steps: int = Field(ge=1, le=100_000, description="H, inner steps per window")
    optimizer: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterConfig
    codec: CodecParams = CodecParams()
    dense: DenseConfig = DenseConfig()
    mask: MaskConfig = MaskConfig()
    lowrank: LowRankConfig = LowRankConfig()
    codec_version: int = Field(CODEC_VERSION, ge=1)
    timing: TimingConfig
    gather_size: int = Field(ge=1, le=4096, description="peers aggregated per window")
    consensus: ConsensusConfig = ConsensusConfig()
    retention: RetentionConfig = RetentionConfig()

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.seq_len > self.model.max_seq_len:
            raise ValueError("seq_len exceeds model.max_seq_len")
        if self.batch_size % self.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        if self.outer.min_support > 1 and self.strategy not in SUPPORTED_STRATEGIES:
            raise ValueError(
                f"outer.min_support counts sparse updates: use it with one of "
                f"{', '.join(SUPPORTED_STRATEGIES)}, not {self.strategy}"
            )
        return self

    # -- identity -------------------------------------------------------------------------

    def _plain(self) -> dict[str, Any]:
        """The config as plain data; an unset `dataset_digest` and the defaults of
        `outer.min_support` and `outer.alpha_at_peak` are left out (so configs made before the
        fields existed keep their run id)."""
        data = self.model_dump(mode="json")
        if data.get("dataset_digest") is None:
            data.pop("dataset_digest", None)
        if data["outer"].get("min_support") == 1:  # the default: ids of earlier configs hold
            data["outer"].pop("min_support")
        if data["outer"].get("alpha_at_peak") is None:
            data["outer"].pop("alpha_at_peak", None)
        return data

    def canonical_json(self) -> bytes:
        """The canonical byte form the run id is computed from."""
        return _canonical(self._plain())

    @property
    def run_id(self) -> str:
        """32 lowercase hex chars: BLAKE2b-128 of the domain tag and the canonical JSON.

        Recomputed on each access (tens of microseconds), so copies made with `model_copy`
        can never carry a stale id.
        """
        h = hashlib.blake2b(digest_size=RUN_ID_HEX_CHARS // 2)
        h.update(_RUN_ID_DOMAIN)
        h.update(self.canonical_json())
        return h.hexdigest()

    @property
    def grad_accum_steps(self) -> int:
        return self.batch_size // self.micro_batch_size

    @property
    def total_inner_steps(self) -> int:
        """Length of the inner learning-rate schedule (cosine horizon)."""
        return self.outer.total_windows * self.inner_steps

    def param_count(self) -> int:
        return self.model.param_count()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, /, **overrides: Any) -> RunConfig:
        """A preset (`tiny`, `150M`, `1B`, `8B`) with nested dicts merged in as overrides.

        Example: ``RunConfig.preset("tiny", inner_steps=5, optimizer={"lr": 3e-3})``.
        """
        if name not in PRESETS:
            raise RunConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return cls.from_dict(_deep_merge(PRESETS[name], overrides))

    def with_overrides(self, **overrides: Any) -> RunConfig:
        """This config with nested dicts merged in as overrides (as `preset` merges them)."""
        return RunConfig.from_dict(_deep_merge(self._plain(), overrides))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """Validate a plain dict; a `run_id` key, if present, must match the recomputed id."""
        if not isinstance(data, Mapping):
            raise RunConfigError("a run config must be a table/object")
        body = dict(data)
        claimed = body.pop("run_id", None)
        try:
            cfg = cls.model_validate(body)
        except ValidationError as e:
            raise RunConfigError(f"invalid run config: {e}") from e
        if claimed is not None:
            require_same_run(cfg.run_id, claimed, "run_id stored in the config")
        return cfg

    @classmethod
    def from_json(cls, text: str | bytes) -> RunConfig:
        if len(text) > MAX_CONFIG_BYTES:
            raise RunConfigError("run config too large")
        try:
            data = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise RunConfigError(f"run config is not valid JSON: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def from_toml(cls, text: str) -> RunConfig:
        if len(text) > MAX_CONFIG_BYTES:
            raise RunConfigError("run config too large")
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as e:
            raise RunConfigError(f"run config is not valid TOML: {e}") from e
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Load a `.toml` or `.json` file (anything else is tried as TOML, then JSON)."""
        path = Path(path)
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise RunConfigError(f"cannot read run config {path}: {e}") from e
        if len(raw) > MAX_CONFIG_BYTES:
            raise RunConfigError(f"run config {path} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RunConfigError(f"run config {path} is not UTF-8") from e
        suffix = path.suffix.lower()
        if suffix == ".json":
            return cls.from_json(text)
        if suffix == ".toml":
            return cls.from_toml(text)
        try:
            return cls.from_toml(text)
        except RunConfigError:
            return cls.from_json(text)

    # -- output ---------------------------------------------------------------------------

    def to_json(self) -> str:
        """Pretty JSON with the run id first (the id is checked again on load)."""
        return json.dumps({"run_id": self.run_id, **self._plain()}, indent=2)

    def to_toml(self) -> str:
        header = f"# Tessera run config. run_id = {self.run_id}\n"
        return header + _to_toml(self._plain())

    def dump(self, path: str | Path) -> Path:
        """Write to `path`: JSON for a `.json` suffix, TOML otherwise. Returns the path."""
        path = Path(path)
        text = self.to_json() if path.suffix.lower() == ".json" else self.to_toml()
        path.write_text(text + "\n", encoding="utf-8")
        return path


def preset_param_count(name: str) -> int:
    """Parameter count of a preset's model (embeddings and, if untied, the LM head included)."""
    return RunConfig.preset(name).param_count()


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a run config")


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# -- a small TOML writer for the shapes a run config has: nested tables of scalars and arrays


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise RunConfigError("non-finite floats cannot be written")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=True)  # JSON string escapes are valid TOML escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise RunConfigError(f"cannot write {type(v).__name__} to TOML")


def _to_toml(table: Mapping[str, Any], prefix: str = "") -> str:
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    lines = [f"{k} = {_toml_value(v)}" for k, v in scalars]
    out = "\n".join(lines)
    for k, sub in tables:
        name = f"{prefix}{k}"
        out += f"\n\n[{name}]\n" + _to_toml(sub, name + ".")
    return out.strip("\n")
