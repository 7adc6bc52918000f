"""The codec's GPU path compiled for a real CUDA device, bit for bit against the CPU path.

The Triton tests (`test_triton_*.py`) run the same kernels under Triton's interpreter on CPU
tensors; this module runs them as built for the GPU (contraction, warp scheduling and the
device's own float arithmetic included) on realistically sized tensors: compression (positions,
codes, side bytes, codebooks, error feedback), the index coder's bytes and indices, a whole
update's wire decode, and the median-clipped mean of several peers. It needs a CUDA device and
compiled kernels, so it runs with ``TRITON_INTERPRET=0``; anywhere else it is skipped with the
reason.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec import gpu, indices, wire
from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor
from codec.spec import CodecParams, ModelSpec
from lab.bench.codec import clustered_subsets, random_subsets
from lab.bench.compress import student_t3
from tests.support.sparse_pieces import as_sparse

# a LLaMA-like block, ragged edges included: full 64x64 tiles plus right and bottom groups
SPEC = ModelSpec.from_shapes(
    {"q": (1024, 1000), "up": (2800, 1024), "down": (1024, 2800), "norm": (1000,)}
)
PARAMS = CodecParams(tile=64, k=64, max_abs_value=2.0**64)
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def compiled_kernels() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: the GPU path is checked under the interpreter instead")
    if (reason := gpu.missing()) is not None:
        pytest.skip(reason)
    from codec.gpu import scatter

    if type(scatter._scatter_add_kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1: run this module with TRITON_INTERPRET=0 on a GPU")


def _pseudo_gradients(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {t.name: student_t3(t.shape, gen) * scale for t in SPEC.tensors}


def _compress(comp: Compressor, deltas: dict[str, torch.Tensor]) -> list[SparseTensor]:
    return [comp.compress(n, d.to(comp.device), 0.95) for n, d in deltas.items()]


def test_compression_is_the_cpu_path_bit_for_bit() -> None:
    cpu, dev = Compressor(SPEC, PARAMS), Compressor(SPEC, PARAMS, device=CUDA)
    for step in range(3):
        deltas = _pseudo_gradients(step)
        if step == 1:  # runs of zeros: ties at the threshold
            deltas["q"].view(-1)[:200_000] = 0.0
        for want, got in zip(_compress(cpu, deltas), _compress(dev, deltas), strict=True):
            for gw, gg in zip(want.groups, got.groups, strict=True):
                assert torch.equal(gw.idx, gg.idx.cpu())
                assert torch.equal(gw.codes, gg.codes.cpu())
                assert torch.equal(gw.scales, gg.scales.cpu())
            assert torch.equal(want.codebook, got.codebook.cpu())
        for t in SPEC.tensors:
            assert torch.equal(cpu.error(t.name), dev.error(t.name).cpu()), t.name


@pytest.mark.parametrize(("make", "k"), [(random_subsets, 64), (clustered_subsets, 128)])
def test_index_coder_bytes_and_indices_match(make: object, k: int) -> None:
    idx = make(np.random.default_rng(k), 8192, 4096, k)  # type: ignore[operator]
    data = indices.encode(idx, 4096, triton=False)
    assert indices.encode(torch.from_numpy(idx).to(CUDA), 4096) == data
    for triton in (None, True, False):  # the device walk (twice), the host walk
        got = indices.decode(data, device=CUDA, triton=triton)
        assert got.device.type == CUDA.type and torch.equal(got.cpu(), torch.from_numpy(idx))


def test_a_whole_update_decodes_to_the_same_tensors() -> None:
    sparse = _compress(Compressor(SPEC, PARAMS), _pseudo_gradients(7))
    data = wire.encode_update(sparse, PARAMS, SPEC, sign=lambda _d: bytes(64))
    on_cpu = as_sparse(wire.decode_update(data, SPEC, PARAMS, len(data)).tensors)
    on_dev = as_sparse(wire.decode_update(data, SPEC, PARAMS, len(data), device=CUDA).tensors)
    assert all(g.idx.device.type == CUDA.type for p in on_dev for g in p.groups)
    out_cpu = aggregate({0: on_cpu}, SPEC, PARAMS)
    for decoded in (on_cpu, on_dev):  # decoded on the host, or whole on the GPU
        out_dev = aggregate({0: decoded}, SPEC, PARAMS, device=CUDA)
        for name, want in out_cpu.items():
            assert torch.equal(want, out_dev[name].cpu()), name


def test_clipped_mean_of_several_peers_is_the_cpu_mean() -> None:
    comp = Compressor(SPEC, PARAMS)
    # scales far apart: clip factors != 1, float32 sums that round differently in another order
    updates = {
        uid: _compress(comp, _pseudo_gradients(10 + uid, 10.0 ** (uid - 3))) for uid in range(6)
    }
    want = aggregate(updates, SPEC, PARAMS, clip_to_median=True)
    on_dev = {uid: [s.to(CUDA) for s in update] for uid, update in updates.items()}
    got = aggregate(on_dev, SPEC, PARAMS, clip_to_median=True, device=CUDA)
    for name in want:
        assert torch.equal(want[name], got[name].cpu()), name
        assert want[name].abs().sum() > 0


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov"])
def test_a_window_on_the_gpu_lands_on_the_cpu_model(optimizer: str) -> None:
    """The whole outer step of a window: strict decode, the strategy's clipped mean and the outer
    optimizer (α not a power of two, momentum), over three windows, on each device."""
    from node.strategy import make_strategy
    from protocol.runconfig import RunConfig

    run = RunConfig.preset("tiny", outer={"optimizer": optimizer, "alpha": 0.7, "total_windows": 9})
    spec = ModelSpec.from_shapes({"w": (512, 384), "b": (384,)})
    cpu, dev = make_strategy(run, spec), make_strategy(run, spec, device=CUDA)
    gen = torch.Generator().manual_seed(3)
    start = {t.name: torch.randn(t.shape, generator=gen) for t in spec.tensors}
    weights = {"cpu": start, "cuda": {n: w.to(CUDA) for n, w in start.items()}}
    for window in range(3):
        datas = []
        for uid in range(5):
            peer = make_strategy(run, spec)
            deltas = {t.name: student_t3(t.shape, gen) * 10.0 ** (uid - 2) for t in spec.tensors}
            meta: dict[str, str | int] = {
                "run_id": run.run_id,
                "window": window,
                "uid": uid,
                "hotkey": "5" * 48,
            }
            datas.append(
                peer.format.to_bytes(
                    peer.encoder.encode(deltas, window), meta, lambda _d: bytes(64)
                )
            )
        for label, strategy in (("cpu", cpu), ("cuda", dev)):
            cap = strategy.format.max_update_bytes()
            updates = {uid: strategy.format.decode(d, cap).tensors for uid, d in enumerate(datas)}
            if label == "cuda":
                updates = {u: [s.to(CUDA) for s in ts] for u, ts in updates.items()}
            strategy.outer.receive(strategy.aggregator.mean(updates), 0)
            weights[label] = strategy.outer.next_weights(weights[label])
        for name, want in weights["cpu"].items():
            assert torch.equal(want, weights["cuda"][name].cpu()), (window, name)
