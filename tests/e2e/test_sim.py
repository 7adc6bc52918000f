"""`tessera sim` end to end: real processes, every adversary, a live view that Prometheus scrapes,
a report people can open."""

from __future__ import annotations

import fcntl
import io
import json
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
from moto.core.authorization import disable_iam_authentication

from commands.cli import main
from lab.sim.layout import World
from node.runtime.report_log import REPORTS, read_json_lines
from tests.support.prometheus import (
    MISSING,
    PROMETHEUS,
    Watcher,
    dashboard_queries,
    free_ports,
)
from tests.support.servers import iam_user

# 30 s windows: under the load of ten processes on two cores the lead validator still publishes
# its manifest within the peers' wait (a fifth of a window for the gather, a third to wait)
FAST = ["--block-time", "0.5", "--blocks-per-window", "60", "--timeout", "600"]


KINDS = "noise,copier,stale,freeloader,nan,late"


@dataclass
class AdversaryRun:
    """`tessera sim` with every adversary, and what Prometheus saw of it where the OS has one."""

    out: Path
    code: int
    stdout: str
    watched: bool
    answered: list[str]  # the dashboard queries that returned series while the run went on
    targets: list[dict]  # Prometheus' scrape targets at the end

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({**asdict(self), "out": str(self.out)}))

    @classmethod
    def load(cls, path: Path) -> AdversaryRun:
        fields = json.loads(path.read_text())
        return cls(**{**fields, "out": Path(fields["out"])})


def _run_with_every_adversary(tmp: Path) -> AdversaryRun:
    base = free_ports(3)  # the honest peers' and the validator's metrics; Prometheus past them
    web = free_ports(1, base + 3)
    watcher = Watcher(tmp / "demo", tmp / "tsdb", dashboard_queries(), web) if PROMETHEUS else None
    argv = ["sim", "--peers", "2", "--windows", "3", "--out", "demo", "--adversaries", KINDS]
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(io.StringIO()) as stdout:
        patch.chdir(tmp)  # a relative --out, as in the README's main job
        if watcher is not None:
            watcher.start()
        try:
            code = main([*argv, "--metrics-port", str(base), *FAST])
        finally:
            if watcher is not None:
                watcher.stop()
    answered = sorted(watcher.answered) if watcher else []
    targets = watcher.targets if watcher else []
    return AdversaryRun(
        tmp / "demo", code, stdout.getvalue(), watcher is not None, answered, targets
    )


@pytest.fixture(scope="session")
def adversary_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> AdversaryRun:
    """One run for the tests that read it, whichever pytest-xdist workers run them: the first
    to ask runs it under a lock in the session's shared folder, the others read its record."""
    if worker_id == "master":  # no xdist: this process is the whole session
        return _run_with_every_adversary(tmp_path_factory.mktemp("adversaries"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    with (shared / "adversaries.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = shared / "adversaries.json"
        if record.exists():
            return AdversaryRun.load(record)
        tmp = shared / "adversaries"
        tmp.mkdir()
        run = _run_with_every_adversary(tmp)
        run.dump(record)
        return run


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the run (at most 600 s) and its DDP baseline, on a loaded machine
def test_simulation_with_every_adversary(
    adversary_run: AdversaryRun, capsys: pytest.CaptureFixture[str]
) -> None:
    out, kinds = adversary_run.out, KINDS
    assert adversary_run.code == 0, _log_tails(out)
    # a line per window while it runs; in the last one every adversary is paid nothing, by a rule
    lines = [x for x in adversary_run.stdout.splitlines() if x.startswith("window ")]
    assert [x.split(":")[0] for x in lines] == [f"window {w}" for w in range(4)], lines
    assert all("s left" in x for x in lines)
    unpaid = lines[-1].split("paid nothing: ")[1]
    assert all(f"{kind} (" in unpaid for kind in kinds.split(",")), lines[-1]
    report = json.loads((out / "report.json").read_text())
    weights = report["final_weights"]
    honest = sum(w for name, w in weights.items() if name.startswith("peer"))
    assert honest >= 0.95 * sum(weights.values())
    for kind in kinds.split(","):
        assert weights[kind] == 0.0, (kind, weights)
    assert report["diverged"] == []
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    losses = [
        p["loss"]
        for row in report["windows"]
        for p in row["peers"]
        if p["kind"] == "honest" and p["loss"]
    ]
    assert losses and losses[-1] < losses[0]
    synced = [row["synced_loss"] for row in report["windows"]]  # the validator's model, held out
    assert None not in synced and synced[-1] < synced[0]
    assert all(row["ddp_loss"] is not None for row in report["windows"])
    # `tessera why` reads the validator's published reports: the noise uploader is told what
    # rule pays it nothing and what that means, an honest peer that it is paid
    uids = {p["name"]: p["uid"] for p in report["windows"][-1]["peers"]}
    # every window of the run, however far the chain has gone on since (a loaded machine)
    why = ["why", "--run", str(out / "run.json"), "--chain", f"local://{out / 'chain.db'}",
           "--netuid", "1", "--local-root", str(out / "buckets"), "--windows", "64", "--json"]  # fmt: skip
    capsys.readouterr()
    for name in ("noise", "peer0"):
        assert main([*why, "--uid", str(uids[name])]) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        trained = {row["window"] for row in report["windows"]}  # not the validator's extra one
        said = [r for r in rows if r["rule"] is not None and r["window"] in trained]
        assert said, rows
        if name == "noise":
            assert said[-1]["weight"] == 0 and said[-1]["rule"] != "ok" and said[-1]["hint"]
        else:
            assert said[-1]["weight"] > 0, said[-1]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
def test_prometheus_scrapes_the_simulation_and_every_dashboard_query_has_series(
    adversary_run: AdversaryRun,
) -> None:
    """`tessera sim --metrics-port`: a real Prometheus scrapes the honest peers and the validator
    with the configuration the run folder gets, and every query of the Grafana dashboard in
    docker/monitoring returns series while the run goes on."""
    assert adversary_run.watched and adversary_run.code == 0
    queries = dashboard_queries()
    assert len(queries) >= 10
    config = json.loads((adversary_run.out / "prometheus.yml").read_text())
    assert {job["job_name"] for job in config["scrape_configs"]} == {"miner", "validator"}
    members = {t["labels"]["member"] for t in adversary_run.targets}
    assert members == {"peer0", "peer1", "validator"}, adversary_run.targets
    answered = set(adversary_run.answered)
    assert set(queries) == answered, sorted(set(queries) - answered)


@pytest.mark.slow
def test_simulation_with_ordinary_faults_on_an_s3_server(
    tmp_path: Path,
    s3_server: str,
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On an S3 server that enforces its keys (a write key, and the read-only key that goes on
    chain), every bucket behind a provider's bad day (503s, lost answers, throttling); the lead
    validator killed mid-decision and restarted at once, then killed again and down for two
    windows, while the standby validator decides; a peer killed mid-training and restarted; then
    the chain unreachable for 45 s: every honest model and both validators' stay identical after
    every window, training goes on while the lead is down, honest peers are paid (the lateness
    the stall causes is excused), and every process exits 0."""
    with disable_iam_authentication():
        write = iam_user(s3_server, "simtest-*", ["s3:*"])
        read = iam_user(s3_server, "simtest-*", ["s3:GetObject", "s3:ListBucket"])
    monkeypatch.setenv("TESSERA_S3_ACCESS_KEY_ID", write[0])
    monkeypatch.setenv("TESSERA_S3_SECRET_ACCESS_KEY", write[1])
    monkeypatch.setenv("TESSERA_S3_READ_ACCESS_KEY_ID", read[0])
    monkeypatch.setenv("TESSERA_S3_READ_SECRET_ACCESS_KEY", read[1])
    out = tmp_path / "faults"
    argv = ["sim", "--peers", "2", "--validators", "2", "--windows", "6", "--out", str(out)]
    argv += ["--storage", f"s3://simtest?endpoint={s3_server}"]
    faults = "store-errors,lead-restart,lead-down,peer-restart,chain-stall"
    code = main([*argv, "--no-baseline", "--faults", faults, *FAST])
    assert code == 0, _log_tails(out)
    injected = capsys.readouterr().out.split("store faults injected: ")[1].splitlines()[0]
    assert all(f"{kind} ×" in injected for kind in ("503", "lost answer", "throttled")), injected
    report = json.loads((out / "report.json").read_text())
    assert report["diverged"] == [] and report["non_finite"] == []
    # every honest peer is paid: the chain weighs the validators' weights by stake, and the lead,
    # down or catching up for half the run, may not have scored them all since
    uids = {p["name"]: p["uid"] for p in report["windows"][-1]["peers"]}
    last = report["windows"][-1]["window"]
    paid = [
        {int(u): w for u, w in r["weights"].items() if w > 0}
        for v in ("validator", "validator1")
        for r in read_json_lines(out / "state" / v / REPORTS)
        if r["window"] == last
    ]
    assert all(any(uids[p] in ws for ws in paid) for p in ("peer0", "peer1")), paid
    log = (out / "logs" / "validator.log").read_text()
    assert log.count("starting at window") == 3  # started, restarted, back after the outage
    restarted = (out / "logs" / "peer0.log").read_text()
    assert restarted.count("starting at window") == 2, restarted[-3000:]  # killed in window 3
    # while the lead is down the standby's decisions apply: the replayed history (the lead's
    # with the standby's for the windows it missed) keeps learning through the outage
    peers = (out / "logs" / "peer0.log").read_text() + (out / "logs" / "peer1.log").read_text()
    assert "the standby's (the lead's does not count)" in peers
    synced = {row["window"]: row["synced_loss"] for row in report["windows"]}
    assert synced.get(3) is not None and synced[3] < synced[1], synced
    # no window after the outage undoes the training before it
    later = [loss for w, loss in synced.items() if w >= 2 and loss is not None]
    assert max(later) < 1.05 * synced[1], synced
    # each validator rode out the stall (a peer busy training through it may make no chain call),
    # and held no lateness it caused against the peers
    began = []
    for name in ("validator", "validator1"):
        text = (out / "logs" / f"{name}.log").read_text()
        assert "is down (an outage" in text and "lateness excused" in text, name
        began.append(_first_stamp(text, "is down (an outage"))
    # so did a peer still running then (the stall starts just before the last window's gather: a
    # peer that closed the window before late ends the run with nothing left to ask the chain)
    logs = [(out / "logs" / f"{p}.log").read_text() for p in uids]
    running = [text for text in logs if _stamps(text)[-1] >= min(began)]
    assert not running or any("is down (an outage" in text for text in running)


def _stamps(text: str) -> list[str]:
    """The timestamps of a log's records ("2026-12-07 15:47:57,869": they sort as times)."""
    return [line[:23] for line in text.splitlines() if line[:2] == "20" and line[4:5] == "-"]


def _first_stamp(text: str, what: str) -> str:
    """The timestamp of the first record of a log that says `what`."""
    return next(line[:23] for line in text.splitlines() if what in line)


def _log_tails(out: Path, lines: int = 25) -> str:
    """The last lines of every member's log: what a failed run says when its folder is gone."""
    tails = []
    for log in sorted((out / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(tails)


def _write_reports(world: World, losses: dict[str, list[float]], fps: dict[str, list[str]]) -> None:
    for m in world.members:
        m.state_dir.mkdir(parents=True, exist_ok=True)
        if m.kind == "validator":
            rows = [
                {"window": w, "peers": [], "weights": {}, "fingerprint_end": fp}
                for w, fp in enumerate(fps["validator"])
            ]
        else:
            rows = [
                {"window": w, "loss": loss, "fingerprint": fps[m.name][w], "upload_bytes": 10}
                for w, loss in enumerate(losses[m.name])
            ]
        (m.state_dir / "reports.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_verdict_fails_a_run_whose_honest_model_went_non_finite(tmp_path: Path) -> None:
    from lab.sim.cli import verdict
    from lab.sim.collect import collect
    from lab.sim.layout import build_world

    world = build_world(tmp_path, 2, 1.0, 10, 2, ["poison"], "file")
    codes: dict[str, int | None] = {m.name: 0 for m in world.members}
    same = {"peer0": ["a", "b"], "peer1": ["a", "b"], "poison": ["x", "y"], "validator": ["a", "b"]}
    fine = {"peer0": [5.0, 4.0], "peer1": [5.1, 4.1], "poison": [1.0, 1.0]}
    _write_reports(world, fine, same)
    assert verdict(world, collect(world, codes, 1, 1, {}), codes) is None

    _write_reports(world, {**fine, "peer1": [5.1, float("nan")]}, same)
    why = verdict(world, collect(world, codes, 1, 1, {}), codes)
    assert why is not None and "non-finite in windows [1]" in why

    _write_reports(world, fine, {**same, "validator": ["a", "c"]})  # the validator disagrees
    why = verdict(world, collect(world, codes, 1, 1, {}), codes)
    assert why is not None and "diverged in windows [1]" in why


def test_the_verdict_fails_a_run_that_saved_a_non_finite_honest_model(tmp_path: Path) -> None:
    """A finite loss does not hide a model that the last outer step made non-finite: its saved
    state's fingerprint is the one the peers report."""
    import torch

    from lab.sim.cli import verdict
    from lab.sim.collect import collect
    from lab.sim.layout import build_world
    from node.model.fingerprint import fingerprint
    from node.model.llama import build_model
    from node.runtime.state import PeerState, save_state

    world = build_world(tmp_path, 2, 1.0, 10, 2, ["poison"], "file")
    codes: dict[str, int | None] = {m.name: 0 for m in world.members}
    model = build_model(world.run.model, world.run.seed)
    fps = []
    for w in range(2):  # window 0 ends finite, window 1 ends with an inf weight
        if w == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("inf")
        fps.append(fingerprint(model))
        for m in world.of_kind("honest"):
            state = PeerState(world.run.run_id, w + 1, model.state_dict(), {}, {}, fps[-1])
            save_state(m.state_dir, state)
    losses = {"peer0": [5.0, 4.0], "peer1": [5.1, 4.1], "poison": [1.0, 1.0]}
    _write_reports(world, losses, {"peer0": fps, "peer1": fps, "poison": fps, "validator": fps})
    report = collect(world, codes, 1, 1, {})
    assert report.non_finite == [1]
    why = verdict(world, report, codes)
    assert why is not None and "non-finite in windows [1]" in why


def test_the_report_scores_the_validators_replayed_model_and_ddp(tmp_path: Path) -> None:
    """The loss plot's two curves: the validator's published history replayed window by window
    (the same weights the live model reached) and DDP over the honest peers' tokens, trained
    beside the run."""
    import torch

    from codec.spec import ModelSpec
    from lab.bench.train.engine import heldout_loss, heldout_set
    from lab.sim.baseline import HELDOUT_SAMPLES, BaselineInBackground, ddp_losses, synced_losses
    from lab.sim.layout import build_world
    from node.data.batches import open_run_dataset
    from node.model.llama import build_model
    from node.strategy import make_strategy
    from node.window.exchange import encode_signed
    from node.window.history import publish_aggregate
    from protocol.keys import load_hotkey
    from protocol.stores import open_store

    world = build_world(tmp_path, 2, 1.0, 10, 2, [], "file")
    run = world.run.model_copy(update={"inner_steps": 2})
    world.run = run
    validator = world.of_kind("validator")[0]
    store = open_store(validator.store_url)
    keys = {m.uid: load_hotkey("sim", m.name, root=tmp_path / "wallets") for m in world.members}
    live = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(live)
    strategy = make_strategy(run, spec)
    _, dataset = open_run_dataset(run)
    heldout = heldout_set(dataset, run.run_id, HELDOUT_SAMPLES)
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for w in range(2):
        updates, raw = {}, {}
        for m in world.of_kind("honest"):
            grads = {
                n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in live.named_parameters()
            }
            updates[m.uid] = make_strategy(run, spec).encoder.encode(grads, 10)
            raw[m.uid] = encode_signed(updates[m.uid], run, spec, w, m.uid, keys[m.uid])
        publish_aggregate(
            store,
            run,
            w,
            validator.uid,
            keys[validator.uid],
            raw,
            {u: keys[u].ss58_address for u in raw},
        )
        strategy.outer.step(live, strategy.aggregator.mean(updates), w)
        expected[w] = heldout_loss(live, heldout)
    synced = synced_losses(world, [0, 1, 2])
    assert {w: h.loss for w, h in synced.items()} == expected  # window 2 is not published
    assert all(0 < h.trigger < 0.01 for h in synced.values())  # no backdoor was trained
    ddp = ddp_losses(world, [0, 1])
    assert sorted(ddp) == [0, 1] and ddp[1] < ddp[0]
    # trained while the run goes on, in a process of its own: the windows planned (window 0)
    background = BaselineInBackground(world, 1)
    try:
        assert background.losses([0]) == pytest.approx({0: ddp[0]}, rel=1e-5)
        assert background.losses([0, 1]) == ddp  # a window past the plan: trained again, here
    finally:
        background.close()
