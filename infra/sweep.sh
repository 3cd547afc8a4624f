#!/usr/bin/env bash
# `make sweep`: servers up, deployments registered, one `sweep/sweep` run with its defaults: 3 reward
# weightings (beta, gamma) = (0.05, 0.1) the recipe's, (1.0, 0.1), (0.05, 1.0) (flows/sweep.py POINTS), each a
# GRPO child run of configs/sweep.yaml (2 trajectory-sampled steps from the shipped warm start, held-out QA on 2
# validation conversations after each), ~5 min a child and 14.5 min in all on a 2-core CPU (measured). It prints the MLflow
# chart view comparing the children as soon as the sweep starts (their curves fill in as steps finish), then a
# table of the children; it exits non-zero, saying why, when the sweep failed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
export PREFECT_HOME="${PREFECT_HOME:-$REPO/infra/state/prefect}"
export PREFECT_API_URL="http://127.0.0.1:${MEMALPHA_PREFECT_PORT:-4200}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true

bash infra/servers.sh start
export MLFLOW_TRACKING_URI="$(cat "$REPO/infra/state/tracking_uri")"  # where the flow runs log (servers.sh)

started=$SECONDS
name="make-sweep-$(date -u +%Y%m%d-%H%M%S)"
log="$REPO/infra/state/$name.log"
runner_log="$REPO/infra/state/runner.log"
echo "triggering sweep/sweep as flow run '$name' (output in $log) ..."
# the flow's progress lines from the runner's log, without Prefect's prefixes (as infra/train.sh shows them)
touch "$runner_log"
offset=$(($(wc -l <"$runner_log") + 1))
lines="sweep of|weighting [0-9]+|warm start|held-out|grpo step|time budget|[0-9.]+ min spent|no GRPO step"
tail -n0 -F --pid=$$ "$runner_log" 2>/dev/null \
    | grep --line-buffered -E "(^| - )($lines)" \
    | sed -u -E "s/^.* - ($lines)/\\1/" &
follow=$!
trap 'kill $follow 2>/dev/null || true' EXIT
set +e
"$REPO/.venv/bin/prefect" deployment run sweep/sweep --flow-run-name "$name" \
    --watch --watch-interval 15 --watch-timeout "${MEMALPHA_SWEEP_TIMEOUT:-3600}" >"$log" 2>&1
status=$?
echo "flow run: $(grep -E "Completed|Failed|Crashed|Cancelled|TimedOut" "$log" | tail -n1)"
set -e
flow_run_id="$(grep -oE 'UUID: *[0-9a-f-]{36}' "$log" | head -n1 | grep -oE '[0-9a-f-]{36}' || true)"
echo
echo "wall time: $((SECONDS - started)) s"
if [[ -z "$flow_run_id" ]]; then
    echo "could not start the flow run; see $log" >&2
    exit 1
fi
"$PY" -m tasks.summary sweep --flow-run-id "$flow_run_id" || true
if [[ $status -ne 0 ]]; then
    why="$(tail -n "+$offset" "$runner_log" | grep -E " - no GRPO step" | tail -n1 | sed -E 's/^.* - //')"
    echo "flow run $flow_run_id did not complete${why:+: $why}; runner log: $runner_log" >&2
    exit "$status"
fi
