#!/usr/bin/env bash
# `make train`: servers up, deployments registered, one `grpo/train` run with the default config,
# wait for it, then print the MLflow run URL and a short summary.
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
name="make-train-$(date -u +%Y%m%d-%H%M%S)"
log="$REPO/infra/state/$name.log"
echo "triggering grpo/train as flow run '$name' (output in $log) ..."
# The terminal shows the flow's progress lines (warm start and GRPO steps with rate and ETA) from the runner's
# log, without Prefect's prefixes; Prefect's event stream goes to $log and the UI.
touch "$REPO/infra/state/runner.log"
tail -n0 -F --pid=$$ "$REPO/infra/state/runner.log" 2>/dev/null \
    | grep --line-buffered -E "warm start|held-out|grpo step|time budget|spent during|block [0-9]+-[0-9]+: checkpoint|registered" \
    | sed -u -E 's/^.* - (warm start|held-out|grpo step|time budget|[0-9.]+ min spent|block|registered)/\1/' &
follow=$!
trap 'kill $follow 2>/dev/null || true' EXIT
set +e
"$REPO/.venv/bin/prefect" deployment run grpo/train --flow-run-name "$name" \
    --watch --watch-interval 15 --watch-timeout "${MEMALPHA_TRAIN_TIMEOUT:-3600}" >"$log" 2>&1
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
"$PY" -m tasks.summary summary --flow-run-id "$flow_run_id" || true
if [[ $status -ne 0 ]]; then
    echo "flow run $flow_run_id did not complete; runner log: $REPO/infra/state/runner.log" >&2
    exit "$status"
fi
