"""`greedylore`: greedy low-rank compression with error feedback and a semi-lazy SVD
(`seeds/greedylore.txt`, Algorithm 3), in this protocol's windows.

Every matrix ``G`` of the model (a tensor of 2 or more dimensions seen as ``rows x rest``, in its
working orientation ``m <= n``, `codec.lowrank.working_shape`) is sent as ``R = P^T G`` in a
rank-``r`` basis ``P`` every node shares, with error feedback ``E ← G − P R`` and ``G = Δ + E``;
every ``τ`` windows (``run.lowrank.tau``) the whole matrix is sent instead (``E`` keeps only the
wire's rounding) and its aggregate ``Ḡ`` gives the shared orthonormal basis ``U``: the
eigenvectors of ``Ḡ Ḡ^T`` (its left singular vectors), computed by `codec.detmath.det_eigh`, the
same bits on every node. ``P`` is ``r`` columns of ``U`` (after a full round: the first ``r``).

**Windowed (the network's).** The paper picks the window's columns by an approximate global
Top-r of ``‖u_j^T G‖``: every node sends ``λ_j = u_j^T G v_j`` with shared random vectors ``v_j``
and the mean ``Λ̄`` decides. Here that choice is *lagged one window*: each update carries the
sketch ``Λ`` of its next matrix as far as it can tell (``E + Δ``: what stays in error feedback
plus the newest pseudo-gradient), and the columns of window ``w + 1`` are the Top-r of ``Λ̄²`` in
window ``w``'s aggregate, so nobody waits for an extra round trip. ``U``, the chosen columns and
the position in the ``τ`` cycle are outer state: checkpoints carry them, catch-up restores them.
The bench's ``greedylore:select=now`` is Algorithm 3 as written (both phases in-process, the
sketch of the current ``G``); ``basis=random`` draws ``P`` at random each window instead
(random-subspace low-rank compression at the same rank and bytes), the paper's baseline.

**Fallback.** 1-D tensors and embeddings (``embed``/``lm_head`` in the name) go through
SparseLoCo (`node.strategy.sparseloco`, its error feedback and 2-bit values), not dense: an
embedding is the largest tensor of a small model (half of `tiny`) and its gradient is row-sparse
(only the tokens seen), which Top-k serves and a rank-``r`` basis does not; sent dense (GaLore's
and GreedyLore's choice in a data centre) it alone would cost several times the rest of the
update. A vector has no low-rank structure, and SparseLoCo keeps ``min(k, n)`` of a short one.

The aggregate of a window is the median-clipped mean (norms: ``‖R‖``, equal to ``‖P R‖`` for an
orthonormal ``P``, plus the sparse part's) of ``R`` (or ``G``) and of ``Λ``, in uid order; the
step applies ``P R̄`` computed by `codec.detmath.det_matmul`. One `LowRankBasis` per node holds
``U``, the columns and the cycle: the format reads it (``P``, the round kind), the encoder
projects with it, the aggregator (`LowRankAggregator.mean`) leaves the window's ``Λ̄``/``Ḡ``
pending in it and the outer step (`LowRankOuter.receive`) commits them, so a peer must compute
the mean itself (every rank of a multi-device peer would need it: greedylore runs on
single-process peers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from codec.aggregate import update_norm
from codec.dense import DenseTensor, add_dense, dense_bytes, exact_norm, to_wire_precision
from codec.detmath import det_eigh, det_matmul
from codec.errors import DecodeError
from codec.lowrank import (
    Projected,
    decode_lowrank,
    encode_lowrank,
    lowrank_header_digest,
    read_lowrank_header,
    working_shape,
)
from codec.spec import ModelSpec
from node.strategy.aggregator import Aggregator
from node.strategy.base import Strategy
from node.strategy.encoder import Encoder
from node.strategy.format import (
    Decoded,
    Factor,
    Header,
    Meta,
    Signer,
    UpdateFormat,
    whole,
)
from node.strategy.outer import OuterOptimizer
from node.strategy.sparseloco import SparseEncoder, SparseFormat
from protocol.runconfig import RunConfig

NAME = "greedylore"
BASIS, SELECT, PHASE = "basis.", "select.", "phase"


def is_projected(name: str, shape: Sequence[int]) -> bool:
    """Sent in a low-rank basis: a matrix that is not an embedding (see module docstring)."""
    return len(shape) >= 2 and "embed" not in name and "lm_head" not in name


def _work(x: torch.Tensor, transposed: bool, m: int, n: int) -> torch.Tensor:
    x = x.reshape(n, m) if transposed else x.reshape(m, n)
    return x.T if transposed else x


def _rest(spec: ModelSpec, matrices: Mapping[str, Any]) -> ModelSpec:
    """The fallback's tensors: every tensor of ``spec`` that is not a projected matrix."""
    return ModelSpec(tensors=tuple(t for t in spec.tensors if t.name not in matrices))


class LowRankBasis:
    """The shared basis ``U``, its chosen columns and the position in the ``τ`` cycle, and the
    window's aggregate pending for the outer step (see the module docstring)."""

    lagged: ClassVar[bool] = True  # select from the previous window's sketches

    def __init__(self, run: RunConfig, spec: ModelSpec) -> None:
        self.run, self.spec, self.rank = run, spec, run.lowrank.rank
        self.shapes = {t.name: tuple(t.shape) for t in spec.tensors}
        self.matrices = {t.name: working_shape(t.shape) for t in spec.tensors
                         if is_projected(t.name, t.shape)}  # fmt: skip
        self.pending: dict[str, torch.Tensor] | None = None
        self.fresh()

    def fresh(self) -> None:
        """Algorithm 3's start: ``U = I``, the first ``r`` columns, a full round first."""
        self._basis = {n: torch.eye(m) for n, (m, _, _) in self.matrices.items()}
        self._select = {
            n: torch.arange(min(self.rank, m)) for n, (m, _, _) in self.matrices.items()
        }
        self._phase = 0
        self._stepped = False

    @property
    def full_round(self) -> bool:
        """Whether this window sends whole matrices."""
        return self._phase == 0

    def projector(self, name: str) -> torch.Tensor:
        """``P`` (m, r) of this window, float32 (columns of the shared basis)."""
        return self._basis[name][:, self._select[name]]

    def sketch(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``λ_j = u_j^T x v_j`` with shared Gaussian ``v_j`` (variance 1/n), wire precision."""
        m, n, _ = self.matrices[name]
        seed = hashlib.blake2b(f"{self.run.run_id}|{name}|{self._phase}".encode(), digest_size=8)
        gen = torch.Generator().manual_seed(int.from_bytes(seed.digest(), "little") >> 1)
        v = torch.randn(m, n, generator=gen).to(x.device) / math.sqrt(n)
        lam = ((self._basis[name].to(x.device).T @ x) * v).sum(1)
        return to_wire_precision(lam, self.run.dense.dtype, self.run.codec.max_abs_value)

    def matrix(self, name: str, values: torch.Tensor, full: bool) -> torch.Tensor:
        """The tensor (its own shape, float32) a projected or whole matrix stands for."""
        tr = self.matrices[name][2]
        x = values if full else det_matmul(self.projector(name), values).to(torch.float32)
        return (x.T if tr else x).reshape(self.shapes[name])

    def commit(self) -> None:
        """After a window's mean: its pending aggregate moves the basis or the selection, and
        the cycle moves on."""
        pending, self.pending = self.pending, None
        if pending is not None and any(bool(v.any()) for v in pending.values()):
            if self.full_round:
                self._new_basis(pending)
            elif self.lagged:
                self.select({n: pending[n + "#L"] for n in self.matrices})
        self._phase = (self._phase + 1) % self.run.lowrank.tau
        self._stepped = True

    def _new_basis(self, full: Mapping[str, torch.Tensor]) -> None:
        """``U`` of every matrix from the eigenvectors of ``Ḡ Ḡ^T`` (batched by size)."""
        by_m: dict[int, list[str]] = {}
        for name, (m, _, _) in self.matrices.items():
            by_m.setdefault(m, []).append(name)
        for m, names in by_m.items():
            _, vectors = det_eigh(torch.stack([det_matmul(full[n], full[n].T) for n in names]))
            for name, u in zip(names, vectors.to(torch.float32), strict=True):
                self._basis[name] = u.clone()
                self._select[name] = torch.arange(min(self.rank, m))

    def select(self, sketch: Mapping[str, torch.Tensor]) -> None:
        """The columns of ``U`` with the largest ``Λ̄²`` (ties: the lower index), ascending."""
        for name, lam in sketch.items():
            r = min(self.rank, len(lam))
            order = torch.argsort(-(lam.double().square()), stable=True)
            self._select[name] = order[:r].sort().values

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``basis.<m>``, ``select.<m>`` per matrix and ``phase`` once a mean was received."""
        out: dict[str, torch.Tensor] = {}
        if not self._stepped:
            return out
        for name in self.matrices:
            out[BASIS + name] = self._basis[name].clone()
            out[SELECT + name] = self._select[name].to(torch.float32)
        out[PHASE] = torch.tensor([float(self._phase)])
        return out

    def load_state_dict(self, mine: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict` (empty: Algorithm 3's start). ValueError unless it is complete,
        finite, a phase of the cycle and distinct columns of each basis."""
        self.fresh()
        if not mine:
            return
        if {k: tuple(v.shape) for k, v in mine.items()} != self.shapes_of_state():
            raise ValueError("greedylore outer state does not match the model's matrices")
        if not all(bool(torch.isfinite(v).all()) for v in mine.values()):
            raise ValueError("greedylore outer state is not finite")
        phase = float(mine[PHASE][0])
        if phase != int(phase) or not 0 <= phase < self.run.lowrank.tau:
            raise ValueError(f"phase {phase} outside the run's cycle")
        for name, (m, _, _) in self.matrices.items():
            sel = mine[SELECT + name]
            if not bool((sel == sel.round()).all()) or len(set(sel.long().tolist())) != len(sel) \
                    or int(sel.min()) < 0 or int(sel.max()) >= m:  # fmt: skip
                raise ValueError(f"{name}: the selected columns are not distinct indices < {m}")
            self._basis[name] = mine[BASIS + name].to(torch.float32).clone()
            self._select[name] = sel.long().sort().values
        self._phase, self._stepped = int(phase), True

    def shapes_of_state(self) -> dict[str, tuple[int, ...]]:
        """The names and shapes `state_dict` holds."""
        out: dict[str, tuple[int, ...]] = {}
        for name, (m, _, _) in self.matrices.items():
            out[BASIS + name] = (m, m)
            out[SELECT + name] = (min(self.rank, m),)
        out[PHASE] = (1,)
        return out

    def is_state(self, key: str) -> bool:
        """Whether an outer-state key is the basis' (not the outer optimizer's)."""
        return key.startswith((BASIS, SELECT)) or key == PHASE


class LowRankFormat(UpdateFormat):
    """``TSRL`` updates: projected (or whole) matrices, SparseLoCo's format for the rest."""

    name = NAME
    dense = False

    def __init__(self, run: RunConfig, spec: ModelSpec, basis: LowRankBasis) -> None:
        super().__init__(run, spec)
        self.basis, self.matrices = basis, basis.matrices
        self.fallback = SparseFormat(run, _rest(spec, self.matrices))

    # -- the wire ----------------------------------------------------------------------------

    def max_update_bytes(self) -> int:
        mats = ModelSpec(tensors=tuple(t for t in self.spec.tensors if t.name in self.matrices))
        return dense_bytes(mats, self.run.dense.dtype) + self.fallback.max_update_bytes()

    def to_bytes(self, update: Sequence[Any], meta: Meta | None, sign: Signer | None) -> bytes:
        run = self.run
        return encode_lowrank(update, self.spec, run.codec, run.dense.dtype, run.lowrank.rank,
                              meta=meta, sign=sign)  # fmt: skip

    def read_header(self, data: bytes | memoryview, max_bytes: int) -> Header:
        return read_lowrank_header(data, max_bytes)[0]

    def signed_digest(self, header: Any) -> bytes:
        return lowrank_header_digest(header)

    def decode(self, data: bytes | memoryview, max_bytes: int) -> Decoded:
        run = self.run
        return decode_lowrank(data, self.spec, set(self.matrices), run.codec, run.dense.dtype,
                              run.lowrank.rank, max_bytes)  # fmt: skip

    # -- one update --------------------------------------------------------------------------

    def validate(self, piece: Any) -> None:
        if piece.name not in self.matrices:
            self.fallback.validate(piece)
            return
        if not isinstance(piece, Projected):
            raise DecodeError(f"{piece.name}: a projected matrix was expected")
        m, n, _ = self.matrices[piece.name]
        if piece.full != self.basis.full_round:
            raise DecodeError(f"{piece.name}: a {'full' if piece.full else 'projected'} matrix "
                              "in the other kind of round")  # fmt: skip
        rows = m if piece.full else min(self.basis.rank, m)
        want = [(piece.values, (rows, n)), (piece.sketch, (0,) if piece.full else (m,))]
        for t, shape in want:
            if t.dtype != torch.float32 or tuple(t.shape) != shape:
                raise DecodeError(f"{piece.name}: values must be float32 {shape}")
            if not bool(torch.isfinite(t).all()):
                raise DecodeError(f"{piece.name}: non-finite value")
            if t.numel() and float(t.abs().max()) > self.run.codec.max_abs_value:
                raise DecodeError(f"{piece.name}: a value exceeds the run's cap")

    def norm(self, update: Sequence[Any]) -> float:
        dense = exact_norm(p.values for p in update if isinstance(p, Projected))
        sparse = update_norm([p for p in update if not isinstance(p, Projected)])
        return math.sqrt(dense * dense + sparse * sparse)

    def add_into(self, out: torch.Tensor, piece: Any, factor: Factor = 1.0) -> None:
        if piece.name not in self.matrices:
            self.fallback.add_into(out, piece, factor)
            return
        x = self.basis.matrix(piece.name, piece.values, piece.full)
        add_dense(out, DenseTensor(piece.name, tuple(out.shape), x), whole(factor))

    def entries(self, piece: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected matrices: every entry of ``R`` (the shared basis' coordinates)."""
        if piece.name not in self.matrices:
            return self.fallback.entries(piece)
        values = piece.values.detach().to("cpu", torch.float32).reshape(-1)
        return torch.arange(values.numel(), dtype=torch.int64), values


class LowRankEncoder(Encoder):
    """Error feedback in the working orientation, projected (or whole) matrices and their
    sketches; SparseLoCo's encoder for the rest."""

    def __init__(
        self, run: RunConfig, spec: ModelSpec, device: torch.device | str, basis: LowRankBasis
    ) -> None:
        super().__init__(run, spec, device)
        self.basis, self.matrices = basis, basis.matrices
        self.fallback = SparseEncoder(run, _rest(spec, self.matrices), self.device)
        self._ef: dict[str, torch.Tensor] = {}

    def _g(self, name: str, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``Δ``, ``G = Δ + E``) of a matrix, working orientation."""
        m, n, tr = self.matrices[name]
        work = _work(delta.detach().to(self.device, torch.float32), tr, m, n)
        if not bool(torch.isfinite(work).all()):
            raise ValueError(f"{name}: delta has non-finite entries")
        ef = self._ef.setdefault(name, torch.zeros(m, n, device=self.device))
        return work, work + ef

    def sketches(self, deltas: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Phase one of Algorithm 3 (bench, ``select=now``): each matrix's ``Λ`` of its current
        ``G``, without changing any state."""
        return {n: self.basis.sketch(n, self._g(n, deltas[n])[1]) for n in self.matrices}

    def encode(self, deltas: Mapping[str, torch.Tensor], window: int) -> list[Any]:
        names = self.owned_order(deltas)
        rest = [n for n in names if n not in self.matrices]
        sparse = dict(zip(rest, self.fallback.encode({n: deltas[n] for n in rest}, window),
                          strict=True))  # fmt: skip
        dtype, cap = self.run.dense.dtype, self.run.codec.max_abs_value
        basis, shapes = self.basis, {t.name: tuple(t.shape) for t in self.spec.tensors}
        out: list[Any] = []
        for name in names:
            if name not in self.matrices:
                out.append(sparse[name])
                continue
            work, g = self._g(name, deltas[name])
            if basis.full_round:
                values = to_wire_precision(g, dtype, cap)
                self._ef[name] = g - values
                out.append(Projected(name, shapes[name], True, values, torch.zeros(0)))
                continue
            p = basis.projector(name).to(g.device)
            values = to_wire_precision(p.T @ g, dtype, cap)
            self._ef[name] = g - p @ values
            # lagged: the next window's G as far as we can tell; now: this window's (Algorithm 3)
            sketch = basis.sketch(name, self._ef[name] + work if basis.lagged else g)
            out.append(Projected(name, shapes[name], False, values, sketch))
        return out

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        out = self.fallback.local_state_dict()
        for name, (m, n, tr) in self.matrices.items():
            ef = self._ef.get(name, torch.zeros(m, n))
            out[name] = (ef.T if tr else ef).reshape(self.basis.shapes[name]).detach().cpu().clone()
        return out

    def load_local_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.fallback.load_local_state_dict({k: v for k, v in state.items()
                                             if k not in self.matrices})  # fmt: skip
        for name, (m, n, tr) in self.matrices.items():
            t = state[name]
            if tuple(t.shape) != self.basis.shapes[name] or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: error feedback has the wrong shape or is not finite")
            self._ef[name] = _work(t.to(self.device, torch.float32), tr, m, n).clone()


class LowRankAggregator(Aggregator):
    """The clipped mean of ``R`` (or ``G``) and ``Λ``, left pending in the basis; ``P R̄``."""

    format: LowRankFormat

    def _zeros(self) -> dict[str, torch.Tensor]:
        basis, out = self.format.basis, {}
        for t in self.spec.tensors:
            if t.name not in basis.matrices:
                out[t.name] = torch.zeros(t.shape, device=self.device)
                continue
            m, n, _ = basis.matrices[t.name]
            out[t.name] = torch.zeros(m if basis.full_round else min(basis.rank, m), n,
                                      device=self.device)  # fmt: skip
            if not basis.full_round:
                out[t.name + "#L"] = torch.zeros(m, device=self.device)
        return out

    def _accumulate(self, sums: dict[str, torch.Tensor], name: str, piece: Any,
                    factor: Factor) -> None:  # fmt: skip
        if name not in self.format.matrices:
            self.format.fallback.add_into(sums[name], piece, factor)
            return
        scale = whole(factor)
        add_dense(sums[name], DenseTensor(name, tuple(piece.values.shape), piece.values), scale)
        if not piece.full:
            add_dense(
                sums[name + "#L"], DenseTensor(name, (len(piece.sketch),), piece.sketch), scale
            )

    def _finish_mean(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        basis = self.format.basis
        basis.pending = {k: v.detach().cpu().clone() for k, v in sums.items()
                         if k in basis.matrices or k.endswith("#L")}  # fmt: skip
        full = basis.full_round
        return {t.name: basis.matrix(t.name, sums[t.name], full).to(self.device)
                if t.name in basis.matrices else sums[t.name] for t in self.spec.tensors}  # fmt: skip


class LowRankOuter(OuterOptimizer):
    """The run's outer step, whose every mean also moves the basis (`LowRankBasis.commit`)."""

    def __init__(
        self, run: RunConfig, spec: ModelSpec, device: torch.device | str, basis: LowRankBasis
    ) -> None:
        super().__init__(run, spec, device)
        self.basis = basis

    def receive(self, mean: Mapping[str, torch.Tensor], window: int) -> None:
        """Hold the window's mean; its aggregate then moves the basis or the selection."""
        super().receive(mean, window)
        self.basis.commit()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **self.basis.state_dict()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        mine = {k: v for k, v in state.items() if self.basis.is_state(k)}
        super().load_state_dict({k: v for k, v in state.items() if k not in mine})
        self.basis.load_state_dict(mine)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {**super().shapes(), **self.basis.shapes_of_state()}

    def keep_rows(self, local: ModelSpec) -> None:
        raise ValueError(f"the {NAME} strategy's outer state cannot be sharded")


def make_greedylore(
    run: RunConfig,
    spec: ModelSpec,
    device: torch.device | str,
    owned: ModelSpec | None,
    basis: LowRankBasis | None = None,
) -> Strategy:
    """GreedyLore's parts around one `LowRankBasis` (``basis``: a bench variant's)."""
    if owned is not None and [t.name for t in owned.tensors] != [t.name for t in spec.tensors]:
        raise ValueError("greedylore needs every tensor in one process (no sharded peers)")
    basis = basis or LowRankBasis(run, spec)
    fmt = LowRankFormat(run, spec, basis)
    return Strategy(
        fmt,
        LowRankEncoder(run, spec, device, basis),
        LowRankAggregator(fmt, device),
        LowRankOuter(run, spec, device, basis),
    )
