"""The simulation's hostile kinds do what they claim, with the real codec, chain and stores.

(That the run survives them is `tests/unit/test_consensus.py`, `tests/unit/test_update_bounds.py` and the
adversarial simulation; here each attack is shown to be the attack it says it is.)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from substrateinterface import Keypair

from codec.aggregate import update_norm
from codec.compress import scatter_add
from codec.errors import DecodeError
from codec.spec import ModelSpec
from lab.sim import adversary as adv_mod
from lab.sim import forgeries as forge
from lab.sim.adversary import Adversary
from lab.sim.layout import build_world
from lab.sim.processes import command
from node.model.llama import build_model
from node.runtime.commit import commitment_for
from node.strategy import make_strategy
from node.window.buckets import peer_buckets
from node.window.exchange import check_update, encode_signed
from node.window.gather import update_request
from node.window.history import publish_aggregate
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import render_commitment
from protocol.keys import create_hotkey
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError
from protocol.stores import ObjectNotFound, ObjectStore, open_store
from protocol.stores.fetch import TooSlow, fetch_many

NETUID = 1
BLOCK = 0.1
# the `world` fixture: hotkeys (victim, adversary, validator), the chain, their stores, a factory
World = tuple[list[Keypair], LocalChain, list[ObjectStore], Callable[[str], Adversary]]

RUN = RunConfig.preset(
    "tiny",
    name="adversaries",
    timing={"block_time_s": BLOCK, "blocks_per_window": 6, "upload_deadline_blocks": 1,
            "clock_skew_tolerance_s": BLOCK},
)  # fmt: skip
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))


def _honest(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return forge.noise_update(SPEC, RUN, 1e-3, gen)


def _dense(update: list) -> dict[str, torch.Tensor]:
    out = {t.name: torch.zeros(t.shape) for t in SPEC.tensors}
    for s in update:
        scatter_add(out[s.name], s, RUN.codec)
    return out


def _cos(a: dict, b: dict) -> float:
    x = torch.cat([a[n].flatten() for n in sorted(a)])
    y = torch.cat([b[n].flatten() for n in sorted(b)])
    return float(x @ y / (x.norm() * y.norm()))


def _victim_uploads(world: World, window: int, update: list) -> None:
    """The honest victim (uid 0) signs and publishes `update` for `window` in its bucket."""
    keys, _, stores, _ = world
    data = encode_signed(update, RUN, SPEC, window, 0, keys[0])
    stores[0].put(update_key(RUN.run_id, window, 0, keys[0].ss58_address), data)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """A fast local chain: uid 0 honest victim, uid 1 the adversary, uid 2 a validator."""
    create_local_chain(tmp_path / "chain.db", NETUID, block_time=BLOCK)
    db = LocalChainDB(tmp_path / "chain.db")
    keys = [create_hotkey("a", name, root=tmp_path / "w") for name in ("victim", "adv", "val")]
    for i, k in enumerate(keys):
        db.register(NETUID, k.ss58_address, validator=i == 2, stake=10.0 if i == 2 else 0.0)
    chain = LocalChain(tmp_path / "chain.db", NETUID)
    root = tmp_path / "buckets"
    for i, k in enumerate(keys):
        url = f"file://{root}?bucket=bucket{i}"
        chain.commit(k, render_commitment(commitment_for(url)))
    stores = [open_store(f"file://{root}?bucket=bucket{i}") for i in range(3)]

    def make(kind: str) -> Adversary:
        return Adversary(
            kind, 1, keys[1], RUN, SPEC, chain, stores[1], root, 0, torch.Generator().manual_seed(5)
        )

    yield keys, chain, stores, make
    chain.close()
    db.close()


def test_poison_is_as_strong_as_decoders_allow() -> None:
    victim = _honest(1)
    admitted = forge.at_the_cap(victim, RUN.codec.max_abs_value)
    for s in admitted:
        s.validate(RUN.codec)  # passes decoding...
    assert update_norm(admitted) >= 10 * update_norm(victim)  # ...at a far larger norm
    assert _cos(_dense(admitted), _dense(victim)) < -0.5  # against the victim's direction
    refused = forge.at_the_cap(victim, 2.0**100)
    with pytest.raises(DecodeError):
        refused[0].validate(RUN.codec)


def test_the_poisoner_uploads_both_variants_against_the_victim(world: World) -> None:
    keys, _, _, make = world
    adv, victim = make("poison"), _honest(11)
    for window in (0, 1):
        _victim_uploads(world, window, victim)
    admitted = _checked(adv, keys, 0, adv_mod._poison(adv, 0))  # even window: it decodes...
    assert update_norm(admitted) >= 10 * update_norm(victim)
    assert _cos(_dense(admitted), _dense(victim)) < -0.5  # ...straight against the victim
    with pytest.raises(DecodeError):  # odd window: 2^100 in the codebook, which decoders refuse
        _checked(adv, keys, 1, adv_mod._poison(adv, 1))


def test_scaled_is_five_times_the_victim() -> None:
    victim = _honest(2)
    five = forge.scaled(victim, 5.0, RUN.codec.max_abs_value)
    a, b = _dense(victim), _dense(five)
    for n in a:
        torch.testing.assert_close(b[n], 5 * a[n], rtol=1e-6, atol=0)


def test_the_scaler_uploads_five_times_the_victims_update(world: World) -> None:
    keys, _, _, make = world
    adv, victim = make("scaled"), _honest(12)
    _victim_uploads(world, 3, victim)
    uploaded = _checked(adv, keys, 3, adv_mod.FORGERS["scaled"](adv, 3))
    a, b = _dense(victim), _dense(uploaded)
    for n in a:
        torch.testing.assert_close(b[n], 5 * a[n], rtol=1e-6, atol=0)


def test_scaled_stops_at_the_cap_decoders_admit() -> None:
    victim, cap = _honest(13), RUN.codec.max_abs_value
    top = max(float(_dense(victim)[n].abs().max()) for n in _dense(victim))
    huge = forge.scaled(victim, 10 * cap / top, cap)  # 10x more than the cap allows
    for s in huge:
        s.validate(RUN.codec)  # still decodes
    a, b = _dense(victim), _dense(huge)
    assert max(float(b[n].abs().max()) for n in b) == pytest.approx(cap, rel=1e-6)
    ratio = torch.cat([(b[n] / a[n])[a[n] != 0] for n in a])
    assert float(ratio.max() - ratio.min()) <= 1e-6 * float(ratio.mean())  # all scaled alike
    assert float(ratio.mean()) > 1.0


def _checked(adv: Adversary, keys: list, window: int, update: list | None) -> list:
    """`update` as the adversary signs it, through the real wire check every peer runs."""
    assert update is not None
    data = adv_mod._signed(adv, window, update)
    return check_update(data, 1, keys[1].ss58_address, RUN, SPEC, window).tensors


def test_sigforge_signs_with_another_key_or_flips_a_byte(world: World) -> None:
    keys, _, stores, make = world
    adv = make("sigforge")
    for window in (0, 1):
        adv_mod._sigforge(adv, window, _honest(3))
        data = stores[1].get(update_key(RUN.run_id, window, 1, keys[1].ss58_address), 1 << 24)
        with pytest.raises(SignatureError):
            check_update(data, 1, keys[1].ss58_address, RUN, SPEC, window)


def test_equivocate_replaces_or_deletes_its_update_while_others_gather(world: World) -> None:
    keys, chain, stores, make = world
    adv = make("equivocate")
    window = max(0, adv.sched.window_of(chain.block())) + 1
    window += window % 2  # even windows replace, odd ones delete
    for w in (window, window + 1):
        adv_mod._equivocate(adv, w, _honest(4))
    first = update_key(RUN.run_id, window, 1, keys[1].ss58_address)
    replaced = check_update(
        stores[1].get(first, 1 << 24), 1, keys[1].ss58_address, RUN, SPEC, window
    )
    assert _cos(_dense(replaced.tensors), _dense(_honest(4))) < 0.5  # not the first version
    with pytest.raises(ObjectNotFound):
        stores[1].get(update_key(RUN.run_id, window + 1, 1, keys[1].ss58_address), 1 << 24)


def test_recycler_uploads_the_last_aggregate(world: World) -> None:
    keys, _, stores, make = world
    # honest peers train the same model on different data: their updates largely agree
    common = {t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(8)) * 1e-3
              for t in SPEC.tensors}  # fmt: skip
    ups = {u: _compressed(common, 0.1, 20 + u) for u in (0, 1)}
    data = {u: encode_signed(up, RUN, SPEC, 3, u, keys[u]) for u, up in ups.items()}
    publish_aggregate(stores[2], RUN, 3, 2, keys[2], data, {u: keys[u].ss58_address for u in data})
    recycled = adv_mod._recycled(make("recycler"), 4)
    assert recycled is not None
    mean = make_strategy(RUN, SPEC).aggregator.mean(ups)
    assert _cos(_dense(recycled), mean) > 0.9
    assert abs(_cos(_dense(recycled), _dense(_honest(9)))) < 0.05  # unlike any other update


def test_recycler_of_unrelated_updates_keeps_what_top_k_can(world: World) -> None:
    keys, _, stores, make = world
    ups = {0: _honest(5), 1: _honest(6)}
    data = {u: encode_signed(up, RUN, SPEC, 5, u, keys[u]) for u, up in ups.items()}
    publish_aggregate(stores[2], RUN, 5, 2, keys[2], data, {u: keys[u].ss58_address for u in data})
    recycled = adv_mod._recycled(make("recycler"), 6)
    assert recycled is not None
    # Top-k of the mean keeps about half of its ~2k entries per chunk: cosine ~ sqrt(energy kept)
    assert _cos(_dense(recycled), make_strategy(RUN, SPEC).aggregator.mean(ups)) > 0.6


def _compressed(common: dict[str, torch.Tensor], noise: float, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    dense = {
        n: v + noise * v.std() * torch.randn(v.shape, generator=gen) for n, v in common.items()
    }
    return forge.from_dense(dense, SPEC, RUN)


def _provenance(mix: list, a: list, b: list) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Which source each chunk of `mix` holds (its positions equal exactly one source's), the
    dense update those chunks add up to, and the number of chunks taken from `b` per group."""
    expected, from_b = {}, []
    for sm, sa, sb in zip(mix, a, b, strict=True):
        layout, flat = sm.layout(RUN.codec), torch.zeros(sm.shape).view(-1)
        for gi, (gm, ga, gb, va, vb) in enumerate(
            zip(sm.groups, sa.groups, sb.groups, sa.values(), sb.values(), strict=True)
        ):
            is_a = (gm.idx == ga.idx).all(1)
            is_b = (gm.idx == gb.idx).all(1)
            assert bool((is_a | is_b).all())  # every chunk whole from one source
            pick_b = is_b & ~is_a
            from_b.append(int(pick_b.sum()))
            idx = torch.where(pick_b[:, None], gb.idx, ga.idx)
            vals = torch.where(pick_b[:, None], vb, va)
            flat[layout.flat_positions(gi, idx).view(-1)] = vals.view(-1)
        expected[sm.name] = flat.view(sm.shape)
    return expected, from_b


def test_chunk_mix_takes_half_the_chunks_whole_from_each_source() -> None:
    a, b = _honest(21), _honest(22)
    mix = forge.chunk_mix(a, b, 0.5, torch.Generator().manual_seed(3), SPEC, RUN)
    for s in mix:
        s.validate(RUN.codec)
    expected, from_b = _provenance(mix, a, b)
    groups = [g.idx.shape[0] for s in a for g in s.groups]
    assert from_b == [round(0.5 * n) for n in groups]  # 50/50 by chunk
    assert _cos(_dense(mix), expected) > 0.99  # the sources' values, re-quantized
    # independent sources of equal energy: each keeps about half of the mix's energy
    assert abs(_cos(_dense(mix), _dense(a)) - 0.5) < 0.1
    assert abs(_cos(_dense(mix), _dense(b)) - 0.5) < 0.1


def test_the_mixer_uploads_a_chunk_mix_of_two_peers(world: World) -> None:
    keys, _, stores, make = world
    adv = make("mixer")
    adv.second_victim = 2
    a, b = _honest(23), _honest(24)
    _victim_uploads(world, 4, a)
    data = encode_signed(b, RUN, SPEC, 4, 2, keys[2])
    stores[2].put(update_key(RUN.run_id, 4, 2, keys[2].ss58_address), data)
    uploaded = _checked(adv, keys, 4, adv_mod.FORGERS["mixer"](adv, 4))  # signed as its own
    expected, from_b = _provenance(uploaded, a, b)
    assert sum(from_b) > 0 and sum(from_b) < sum(g.idx.shape[0] for s in a for g in s.groups)
    assert _cos(_dense(uploaded), expected) > 0.99


def test_the_simulation_gives_the_mixer_two_honest_sources(tmp_path: Path) -> None:
    world = build_world(tmp_path, 2, 1.0, 10, 2, ["mixer"], "file")
    cmd = command(world, world.of_kind("mixer")[0], 2)
    parser = argparse.ArgumentParser()
    adv_mod.add_arguments(parser)
    args = parser.parse_args(cmd[1:])
    assert args.kind == "mixer"
    assert [args.victim, args.second_victim] == [m.uid for m in world.of_kind("honest")]


def test_slowdrip_serves_its_bucket_one_byte_per_second(world: World, tmp_path: Path) -> None:
    _, chain, _, make = world
    adv = make("slowdrip")
    adv_mod._serve_slowly(adv, f"file://{tmp_path / 'buckets'}?bucket=bucket1")
    adv_mod._upload(adv, 0, _honest(7))
    time.sleep(3 * BLOCK)
    bucket = peer_buckets(chain, tmp_path / "buckets")[0][1]
    assert "127.0.0.1" in bucket.store.location  # everyone now reads it from its own server
    got = fetch_many(
        {1: update_request(bucket, RUN, SPEC, 0)}, budget_s=2.0, min_rate_bytes_s=1024, grace_s=0.5
    )
    assert isinstance(got[1], TooSlow)
