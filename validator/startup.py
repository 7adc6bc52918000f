"""Where a validator starts: its saved state, or, with none, the run's published history.

`begin` restores the saved state (the model, its outer state, the ratings, the copy-detection
history and the key of the evaluation secrets) or, with none, rebuilds the model from the
history any validator published up to the current window and starts the rest afresh.
`skip_pruned` does the same mid-run when the chain node no longer keeps the roster of our next
window (we were down longer than it keeps state).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from codec.errors import TesseraError
from node.model.fingerprint import fingerprint
from node.runtime.state import check_restored, restoring
from node.strategy import Strategy
from node.window.history import Source, catch_up_any
from protocol.chain.errors import BlockPruned
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.copies import SketchHistory
from validator.ratings import Book
from validator.reveal import new_reveal_key
from validator.state import load_state

log = logging.getLogger(f"tessera.{__name__}")


class ValidatorError(TesseraError, RuntimeError):
    """The validator cannot go on (the reason says what the operator can do)."""


@dataclass
class Start:
    """What a validator starts from; `model` and the strategy's outer state are already set."""

    next_window: int
    fingerprint: str
    salt: int
    book: Book
    history: SketchHistory
    reveal_key: bytes
    resumed: bool  # from a saved state (else a first start: the run config is to be published)
    unsaved: bool  # holds what is not on disk yet (a new key must be before any commitment)


def begin(
    state_dir: Path,
    run: RunConfig,
    cfg: ValidatorConfig,
    model: nn.Module,
    strategy: Strategy,
    current_window: int,
    sources: Callable[[], Sequence[Source]],
) -> Start:
    """The saved state of this run in `state_dir`, loaded into `model` and `strategy`; with
    none, the model replayed from `sources()` (every validator's published history) up to
    `current_window`. `StateError` for a state this model cannot take."""
    state = load_state(state_dir, run.run_id)
    if state is None:
        reached = 0
        if current_window > 0:
            reached = catch_up_any(model, strategy.aggregator, strategy.outer, sources(), 0,
                                   current_window)  # fmt: skip
            log.info("started mid-run: model rebuilt from published history up to window %d",
                     reached)  # fmt: skip
        return Start(
            reached, fingerprint(model), secrets.randbits(63), Book(cfg),
            SketchHistory(cfg.history_windows), new_reveal_key(), resumed=False, unsaved=True,
        )  # fmt: skip
    with restoring(state_dir):
        model.load_state_dict(state.model)
        strategy.outer.load_state_dict(state.outer)
    check_restored(state_dir, fingerprint(model), state.fingerprint)
    log.info("resumed at window %d (fingerprint %s)", state.window, state.fingerprint[:12])
    return Start(
        state.window, state.fingerprint, state.salt, Book(cfg, state.records),
        SketchHistory(cfg.history_windows, state.sketches),
        state.reveal_key or new_reveal_key(),  # a state from before commit-reveal has none
        resumed=True, unsaved=not state.reveal_key,
    )  # fmt: skip


def skip_pruned(
    model: nn.Module,
    strategy: Strategy,
    others: Sequence[Source],
    next_window: int,
    current_window: int,
    exc: BlockPruned,
) -> int:
    """Replay the windows from `next_window` to `current_window` from the other validators'
    published history (`others`) into `model`, when the chain node no longer keeps the roster
    block of `next_window`; the window reached. `ValidatorError` if nothing replays them."""
    log.warning(
        "window %d: the chain no longer keeps its roster (%s): catching up to window %d "
        "from published history", next_window, exc, current_window,
    )  # fmt: skip
    s = strategy
    reached = catch_up_any(model, s.aggregator, s.outer, others, next_window, current_window)
    if reached <= next_window:
        raise ValidatorError(
            f"window {next_window}'s roster block is pruned on this chain node and no "
            "validator's published history replays it: point --chain at an archive node "
            "(`--chain archive`)"
        ) from exc
    return reached
