#!/usr/bin/env bash
# A real run of docker/compose.yml's `local` profile on this machine's Docker engine (no GPU, no
# image registry): builds the image on a local base, starts the local profile with a CPU miner
# (2 gloo ranks) and a validator, MinIO replaced by moto (docker/compose.smoke.yml), and checks:
#   1. at least 3 windows pass and the validator scored and aggregated the miner;
#   2. `docker compose stop` saves the miner's state and `start` resumes it;
#   3. a host-owned 0600 hotkey works with the documented `user: "${UID}:${GID}"` mapping, and
#      without it the entrypoint refuses to start and prints that fix;
#   4. the `sim` profile runs `tessera sim --storage s3://…` against the same server and writes
#      its report, owned by the mapped user, into the mounted folder;
#   5. the `monitoring` profile's Prometheus (an image of Debian's `prometheus` package on the
#      same base, as no registry is reachable) scrapes the local miner and validator by service
#      name, and every query of the Grafana dashboard returns series. Grafana itself is not run:
#      Debian does not package it and its image cannot be pulled here (PROMETHEUS_IMAGE and
#      GRAFANA_IMAGE point the profile at pulled images on a machine that can).
# Prints the build time, image size and time to the first window. Skips (exit 0, reason printed)
# when no Docker daemon or Compose v2 is there.
#
#   BASE_IMAGE=tessera-base:bookworm bash scripts/compose-smoke.sh   # Debian base made locally
#   KEEP=1 ...                                                       # leave the stack running
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE_IMAGE=${BASE_IMAGE:-tessera-base:bookworm}
IMAGE=${IMAGE:-tessera:smoke}
HOST_UID=${HOST_UID:-1000}  # a non-root host user who owns the wallet
WINDOWS=${WINDOWS:-3}
PROJECT=tessera-smoke

skip() { echo "SKIP compose smoke: $*"; exit 0; }
fail() { echo "FAIL compose smoke: $*" >&2; if [ -n "${WORK:-}" ]; then compose logs --tail 60 >&2 || true; fi; exit 1; }
docker info >/dev/null 2>&1 || skip "no Docker daemon (start one: dockerd --iptables=false &)"
docker compose version --short 2>/dev/null | grep -q '^v\?2\.' || skip "no Docker Compose v2 plugin"
docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || skip "no base image $BASE_IMAGE (README, Docker)"

# -- 1. build ----------------------------------------------------------------------------------
# Offline/proxied machines: pip's find-links wheels and CA bundle go to the deps stage only.
for dir in ${PIP_FIND_LINKS:-}; do
    for wheel in "$dir"/torch-*.whl; do
        [ -f "$wheel" ] && ln -f "$wheel" docker/build-extra/ 2>/dev/null || cp -n "$wheel" docker/build-extra/ 2>/dev/null || true
    done
done
[ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ] && cp "$PIP_CERT" docker/build-extra/ca.crt
builder=()
docker buildx version >/dev/null 2>&1 || builder=(env DOCKER_BUILDKIT=0)
start=$(date +%s)
"${builder[@]}" docker build --network host -q -f docker/Dockerfile \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg "EXTRA_PACKAGES=moto[server]>=5.0.20" \
    -t "$IMAGE" . >/dev/null
build_s=$(( $(date +%s) - start ))
size=$(docker image inspect "$IMAGE" --format '{{.Size}}')
echo "build: ${build_s} s, image ${IMAGE}: $(( size / 1000000 )) MB"

# -- the project: docker/ with the example env files, a wallet owned by HOST_UID --------------
WORK=$(mktemp -d /tmp/tessera-smoke.XXXXXX)
mkdir -p "$WORK/docker" "$WORK/runs"
cp docker/compose.yml docker/compose.smoke.yml "$WORK/docker/"
python3 - "$WORK" "$HOST_UID" "$IMAGE" <<'EOF'
import re, sys
from pathlib import Path
work, uid, image = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
text = Path("docker/.env.example").read_text()
for key, value in {"UID": uid, "GID": uid, "WALLETS": f"{work}/wallets", "IMAGE": image,
                   "SHM_SIZE": "256mb", "LOCAL_RUN": "/config/run.toml"}.items():
    text = re.sub(rf"(?m)^{key}=.*$", f"{key}={value}", text)
(work / "docker" / ".env").write_text(text + f"SMOKE_RUN_CONFIG={work}/config/run.toml\n")
EOF
# The run: the tiny preset with 40 one-second blocks per window (a loaded 2-core box), and the
# miner's hotkey made as HOST_UID (mode 0600, owned by that host user); the chain job creates the
# validator's the same way through the user mapping. Both made with the image's own Python.
mkdir -p "$WORK/wallets" "$WORK/config"
chown "$HOST_UID:$HOST_UID" "$WORK/wallets" "$WORK/config" "$WORK/runs"
chmod 700 "$WORK/wallets"
chmod 755 "$WORK"
docker run --rm --network none --user "$HOST_UID:$HOST_UID" -v "$WORK:/smoke" --entrypoint python \
    "$IMAGE" -c "
from lab.sim.layout import sim_run_config
from protocol.keys import create_hotkey
sim_run_config(100, 1.0, 40).dump('/smoke/config/run.toml')
create_hotkey('local', 'miner', root='/smoke/wallets')"
[ "$(stat -c '%u %a' "$WORK/wallets/local/hotkeys/miner")" = "$HOST_UID 600" ] \
    || fail "the host hotkey is not owned by $HOST_UID with mode 0600"

# -- 5a. a Prometheus image made from Debian's package on the same base -------------------------
PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-tessera-prometheus:smoke}
if ! docker image inspect "$PROMETHEUS_IMAGE" >/dev/null 2>&1; then
    "${builder[@]}" docker build --network host -q -t "$PROMETHEUS_IMAGE" - >/dev/null <<EOF || fail "could not build $PROMETHEUS_IMAGE"
FROM $BASE_IMAGE
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
fi
export PROMETHEUS_IMAGE PROMETHEUS_PORT=${PROMETHEUS_PORT:-19090}
cp -r docker/monitoring "$WORK/docker/"

compose() { docker compose -p "$PROJECT" -f "$WORK/docker/compose.yml" -f "$WORK/docker/compose.smoke.yml" --profile local --profile monitoring "$@"; }
cleanup() {
    if [ -z "${KEEP:-}" ]; then
        compose down -v --remove-orphans >/dev/null 2>&1 || true
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# reports.jsonl of a node (one JSON line per finished window)
reports() { compose exec -T "$1" sh -c "cat /data/state/$2/*/*/reports.jsonl 2>/dev/null" || true; }
wait_for() {  # seconds, description, command...
    local until=$(( $(date +%s) + $1 )) what=$2; shift 2
    until "$@"; do
        [ "$(date +%s)" -lt "$until" ] || fail "timed out waiting for $what"
        sleep 3
    done
}

# -- 3a. without the user mapping the entrypoint refuses with the fix ----------------------------
compose up -d minio buckets chain >/dev/null 2>&1 || fail "local storage or chain job did not start"
set +e
refusal=$(compose run --rm --no-deps --user 10001:10001 local-miner 2>&1)
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "the image's default user did not get the wallet refusal (rc $rc): $refusal"
grep -q 'user: "${UID}:${GID}"' <<<"$refusal" || fail "no user-mapping fix printed: $refusal"
echo "ok: without the mapping the miner refuses to start and prints: user: \"\${UID}:\${GID}\""

# -- 2. the local profile: windows, scores -------------------------------------------------------
start=$(date +%s)
compose up -d minio buckets chain local-miner local-validator prometheus >/dev/null 2>&1 || fail "compose up failed"
first_window() { [ -n "$(reports local-miner miner)" ]; }
wait_for 900 "the miner's first window" first_window
first_s=$(( $(date +%s) - start ))
echo "time to first window: ${first_s} s (containers started, chain made, corpus built)"

scored() {  # windows whose report scores the miner: update accepted, loss probe positive
    reports local-validator validator | python3 -c "
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
good = [r['window'] for r in rows for p in r['peers']
        if p['uid'] == 0 and p['verdict'] == 'ok' and p['aggregated'] and (p['loss'] or {}).get('score', 0) > 0]
sys.exit(0 if len(good) >= $WINDOWS else 1)"
}
wait_for $(( 120 * WINDOWS + 300 )) "$WINDOWS windows in which the validator scored the miner" scored
echo "ok: the validator scored and aggregated the miner (uid 0) in >= $WINDOWS windows:"
reports local-validator validator | python3 -c "
import json, sys
for r in map(json.loads, filter(str.strip, sys.stdin)):
    p = r['peers'][0] if r['peers'] else {}
    score = (p.get('loss') or {}).get('score')
    print(f'   window {r[\"window\"]}: verdict {p.get(\"verdict\")}, loss score {score}, aggregated {r[\"aggregated\"]}, weights {r[\"weights\"] or r[\"weights_status\"]}')"

# -- 5b. Prometheus scrapes both nodes and answers every dashboard query -------------------------
dashboard_answers() {
    python3 - "$PROMETHEUS_PORT" docker/monitoring/grafana/dashboards/tessera.json <<'EOF'
import json, sys, urllib.parse, urllib.request
port, dashboard = sys.argv[1], json.load(open(sys.argv[2]))
def api(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=10) as r:
        return json.load(r)["data"]
try:
    up = {t["labels"]["instance"] for t in api("targets")["activeTargets"] if t["health"] == "up"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]
    silent = [e for e in exprs if not api("query?" + urllib.parse.urlencode({"query": e}))["result"]]
except OSError as e:
    sys.exit(print(f"   prometheus: {e}"))
missing = {"local-miner:9100", "local-validator:9101"} - up
print(f"   prometheus: targets up {sorted(up)}; dashboard queries without series: {silent}")
sys.exit(1 if missing or silent else 0)
EOF
}
wait_for 300 "Prometheus to scrape both nodes and answer every dashboard query" dashboard_answers
echo "ok: the monitoring profile's Prometheus scrapes local-miner and local-validator; every dashboard query has series"
compose stop prometheus >/dev/null 2>&1

# -- 2b. stop saves state, start resumes it ------------------------------------------------------
compose stop local-miner >/dev/null 2>&1
saved=$(compose logs local-miner 2>&1 | grep -o 'stopped by SIGTERM at window [0-9]*' | tail -n 1)
[ -n "$saved" ] || fail "the miner did not report a clean SIGTERM stop"
window=${saved##* }
echo "ok: docker compose stop: $saved"
compose start local-miner >/dev/null 2>&1
resumed() { compose logs local-miner 2>&1 | grep -q "resumed at window $window"; }
wait_for 300 "the miner to resume at window $window" resumed
more() { reports local-miner miner | python3 -c "
import json, sys
sys.exit(0 if max(json.loads(l)['window'] for l in sys.stdin if l.strip()) >= $window else 1)"; }
wait_for 300 "a window after the restart" more
echo "ok: docker compose start resumed at window $window and trained on"

# -- 3b. the host-owned 0600 hotkey worked through the mapping -----------------------------------
owner=$(stat -c '%u %a' "$WORK/wallets/local/hotkeys/miner")
[ "$owner" = "$HOST_UID 600" ] || fail "the hotkey changed owner or mode: $owner"
echo "ok: the miner signed with a hotkey owned by uid $HOST_UID, mode 0600 (user: \"\${UID}:\${GID}\")"
# -- 4. the sim profile against the same S3 server (the local nodes stopped first) -----------------
compose stop local-miner local-validator >/dev/null 2>&1
start=$(date +%s)
compose --profile sim run --rm sim sim --storage 's3://tessera-sim?endpoint=http://minio:9000' \
    --out /runs/sim --force --peers 2 --windows 2 --blocks-per-window 40 --no-baseline \
    >"$WORK/sim.log" 2>&1 || fail "the sim profile failed: $(tail -n 20 "$WORK/sim.log")"
sim_s=$(( $(date +%s) - start ))
python3 - "$WORK/runs/sim/report.json" <<'EOF' || fail "the sim profile's report is not what it should be"
import json, sys
report = json.load(open(sys.argv[1]))
assert report["diverged"] == [] and all(c == 0 for c in report["exit_codes"].values()), report
EOF
[ "$(stat -c '%u' "$WORK/runs/sim/report.html")" = "$HOST_UID" ] || fail "the sim report is not owned by $HOST_UID"
echo "ok: the sim profile ran 2 peers for 2 windows on the S3 server in ${sim_s} s, report in runs/sim/"
echo "PASS compose smoke (Grafana not run, see the top): build ${build_s} s, image $(( size / 1000000 )) MB, first window ${first_s} s, sim profile ${sim_s} s"
