"""The validator's tunables (not part of the run config: validators may differ, peers never read them).

Every figure below is documented where it is used; the defaults are the ones measured in
`scripts/experiments/validator_separation.py` (see the module docstrings of `copies`, `scoring`, `ratings`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ProbeState = Literal["auto", "device", "host"]


class ValidatorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # fetching
    fetch_timeout_s: float = Field(60.0, gt=0, description="per-peer time for update + fingerprint")
    fetch_workers: int = Field(8, ge=1, le=256)
    # fast filters
    norm_ratio: float = Field(10.0, gt=1, description="norm > ratio x median norm is an outlier")
    # copies and replays (see `validator.copies`)
    # measured (scripts/experiments/validator_separation.py, tiny, 4 peers x 5 windows): honest shares by the
    # window's others <= 0.375 and by one earlier object <= 0.606; copies, mixes and Top-k of
    # sums >= 0.898; recycled aggregates and replays >= 0.950
    copy_threshold: float = Field(
        0.65, gt=0, le=1, description="share of an update this window's earlier uploads explain"
    )
    replay_threshold: float = Field(
        0.8, gt=0, le=1, description="share of an update one earlier update or aggregate explains"
    )
    sketch_size: int = Field(1 << 16, ge=256, description="sampled index positions per update")
    history_windows: int = Field(4, ge=0, le=64, description="earlier windows checked for replays")
    # loss scoring (see `validator.scoring`)
    score_scale: float = Field(
        0.2, gt=0, le=1, description="probe step = score_scale * alpha * median norm (normalised)"
    )
    n_random: int = Field(64, ge=2, description="random training samples per window")
    n_own: int = Field(64, ge=2, description="samples of the peer's own assignment")
    norm_band: float = Field(
        2.0, gt=1, description="a norm outside [median/band, band*median] lowers the score"
    )
    own_z_pass: float = Field(
        2.0, gt=0, description="one window's own_z that the report calls a pass (information)"
    )
    admit_z: float = Field(
        1.5,
        description="own_z an update of this window needs to be applied (`validator.admission`)",
    )
    admit_min_effect: float = Field(
        1e-5, description="own-data effect (relative loss) an update needs to be applied"
    )
    max_scored: int | None = Field(
        None,
        ge=0,
        description="peers scored per window after the agreement, the applied ones first (0: "
        "all; default: twice the run's gather size, whatever the number of registered hotkeys)",
    )
    probe_state: ProbeState = Field(
        "auto",
        description="where the probe's copies of the weights and the window's mean live: beside "
        "the model, on the host, or auto: the host where the GPU cannot hold them",
    )
    # ratings and weights (see `validator.ratings`)
    ema_rate: float = Field(0.3, gt=0, le=1, description="weight of the newest window in EMAs")
    own_windows: int = Field(6, ge=1, le=64, description="scored windows pooled in own_z")
    own_z_low: float = Field(
        3.5, gt=0, description="pooled own-data statistic at or below which a peer earns nothing"
    )
    own_z_full: float = Field(
        5.0, gt=0, description="pooled own-data statistic from which a peer earns fully"
    )
    effect_full: float = Field(
        0.8, gt=0, description="own-data effect (of the window's upper quartile) paid in full"
    )
    penalty_decay: float = Field(0.5, ge=0, lt=1, description="penalty kept per clean window")
    penalty_missing: float = Field(0.5, ge=0, le=1)
    penalty_late: float = Field(0.5, ge=0, le=1)
    penalty_invalid: float = Field(1.0, ge=0, le=1)
    penalty_copy: float = Field(1.0, ge=0, le=1)
    # cadence
    weights_every: int = Field(1, ge=1, description="set weights every M windows")
    checkpoint_every: int = Field(10, ge=1, description="publish a checkpoint every N windows")

    @model_validator(mode="after")
    def _ramp(self) -> ValidatorConfig:
        if self.own_z_full <= self.own_z_low:
            raise ValueError("own_z_full must exceed own_z_low")
        return self

    def scored_per_window(self, gather_size: int) -> int:
        """The most peers scored after a window's agreement (0: all) for a run of `gather_size`:
        a validator's probes are bounded by the run, not by how many hotkeys registered."""
        return 2 * gather_size if self.max_scored is None else self.max_scored
