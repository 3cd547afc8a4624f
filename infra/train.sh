#!/usr/bin/env bash
# `make train`: servers up, deployments registered, one `grpo/train` run with the default config,
# wait for it, then print the MLflow run URL and a short summary. MEMALPHA_TRAIN_MINUTES=N sets the
# run's time_budget_minutes (`null`: no limit); it exits non-zero, saying why, when the run trained nothing.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="$REPO/.venv/bin/python"
export PREFECT_HOME="${PREFECT_HOME:-$REPO/infra/state/prefect}"
export PREFECT_API_URL="http://127.0.0.1:${MEMALPHA_PREFECT_PORT:-4200}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true

bash infra/servers.sh start
export MLFLOW_TRACKING_URI="$(cat "$REPO/infra/state/tracking_uri")"  # where the flow runs log (servers.sh)

params=()
if [[ -n "${MEMALPHA_TRAIN_MINUTES:-}" ]]; then
    # the whole config: a partial one would be completed with the code's defaults, not configs/default.yaml's
    config="$("$PY" -c 'import json, sys
from flows import DEFAULT_CONFIG_FILE
from memalpha.config import ConfigError, load_config
try:
    config = load_config(DEFAULT_CONFIG_FILE, ["time_budget_minutes=" + sys.argv[1]])
except ConfigError as error:
    sys.exit(f"MEMALPHA_TRAIN_MINUTES: {error}")
print(json.dumps({"config": config.model_dump(mode="json")}))' "$MEMALPHA_TRAIN_MINUTES")"
    params=(--params "$config")
fi

started=$SECONDS
name="make-train-$(date -u +%Y%m%d-%H%M%S)"
log="$REPO/infra/state/$name.log"
runner_log="$REPO/infra/state/runner.log"
echo "triggering grpo/train as flow run '$name' (output in $log) ..."
# The terminal shows the flow's progress lines (warm start, held-out checks, GRPO steps with rate and ETA and,
# in a long step, where it is) from the runner's log, without Prefect's prefixes: only lines that start with
# them, so the tracebacks and state messages that repeat a failure's text stay in $log and the UI.
touch "$runner_log"
offset=$(($(wc -l <"$runner_log") + 1))
lines="warm start|held-out|grpo step|time budget|[0-9.]+ min spent|block [0-9]+-[0-9]+: checkpoint|registered|no GRPO step"
tail -n0 -F --pid=$$ "$runner_log" 2>/dev/null \
    | grep --line-buffered -E "(^| - )($lines)" \
    | sed -u -E "s/^.* - ($lines)/\\1/" &
follow=$!
trap 'kill $follow 2>/dev/null || true' EXIT
set +e
"$REPO/.venv/bin/prefect" deployment run grpo/train --flow-run-name "$name" ${params[@]+"${params[@]}"} \
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
    why="$(tail -n "+$offset" "$runner_log" | grep -E " - no GRPO step" | tail -n1 | sed -E 's/^.* - //')"
    echo "flow run $flow_run_id did not complete${why:+: $why}; runner log: $runner_log" >&2
    exit "$status"
fi
