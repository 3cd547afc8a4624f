# PostgreSQL for MLflow and Prefect (`make up DB=postgres`), sourced by infra/servers.sh.
#
# A cluster of its own under $STATE/postgres: installed from Debian's packages where missing, initialised
# once, owned by an unprivileged user (the `postgres` system user when run as root, else the caller),
# listening on 127.0.0.1:$PG_PORT only, role `memalpha` with a generated password kept in
# $STATE/postgres/password and a libpq password file $STATE/postgres/pgpass (both mode 600). Clients find
# the password through PGPASSFILE, so no URI, command line or log carries it. Databases: mlflow, prefect.
#
# A team's server instead: set MLFLOW_BACKEND_STORE_URI (or MEMALPHA_MLFLOW_DB_URI) and
# PREFECT_API_DATABASE_CONNECTION_URL (or MEMALPHA_PREFECT_DB_URI); nothing is started then.

PG_PORT="${MEMALPHA_PG_PORT:-5433}"
PG_DIR="$STATE/postgres"
PG_DATA="$PG_DIR/data"
PG_ROLE=memalpha
export PGPASSFILE="$PG_DIR/pgpass"

pg_bin() {  # the server binaries: Debian's versioned folder, else PATH
    local dir
    dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    if [[ -n "$dir" && -x "$dir/initdb" ]]; then echo "$dir"; return; fi
    if command -v initdb >/dev/null; then dirname "$(command -v initdb)"; return; fi
    return 1
}

pg_install() {
    if pg_bin >/dev/null; then return; fi
    echo "postgres: installing PostgreSQL from Debian's packages"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    pg_bin >/dev/null || { echo "postgres: no initdb after installing the postgresql package" >&2; return 1; }
}

# as the cluster's owner: root hands the server to the `postgres` system user (PostgreSQL refuses root)
pg_as_owner() {
    if [[ "$(id -u)" == 0 ]]; then
        id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

pg_init() {  # the run folder (socket, server log) belongs to the cluster's owner too
    if [[ -f "$PG_DATA/PG_VERSION" ]]; then return; fi
    local bin pwfile
    bin="$(pg_bin)"
    mkdir -p "$PG_DIR/run"
    (umask 077; openssl rand -hex 24 >"$PG_DIR/password")
    (umask 077; echo "127.0.0.1:$PG_PORT:*:$PG_ROLE:$(cat "$PG_DIR/password")" >"$PGPASSFILE")
    pwfile="$(mktemp)"
    cp "$PG_DIR/password" "$pwfile"
    mkdir -p "$PG_DATA"
    if [[ "$(id -u)" == 0 ]]; then
        id postgres >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin postgres
        chown postgres "$pwfile" "$PG_DATA" "$PG_DIR/run"
        if ! runuser -u postgres -- test -x "$PG_DATA"; then
            echo "postgres: the postgres user cannot reach $PG_DATA (a parent folder lacks o+x); set MEMALPHA_STATE elsewhere" >&2
            rm -f "$pwfile"
            return 1
        fi
    fi
    chmod 700 "$PG_DATA"
    pg_as_owner "$bin/initdb" -D "$PG_DATA" -U "$PG_ROLE" --pwfile="$pwfile" --auth=scram-sha-256 \
        --encoding=UTF8 >"$PG_DIR/initdb.log" 2>&1 || { rm -f "$pwfile"; cat "$PG_DIR/initdb.log" >&2; return 1; }
    rm -f "$pwfile"
}

pg_running() { [[ -f "$PG_DATA/postmaster.pid" ]] && pg_as_owner "$(pg_bin)/pg_ctl" -D "$PG_DATA" status >/dev/null 2>&1; }
pg_healthy() { "$(pg_bin)/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; }

pg_psql() { psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U "$PG_ROLE" -d postgres -v ON_ERROR_STOP=1 "$@"; }

start_postgres() {
    pg_install
    pg_init
    if pg_running; then
        echo "postgres: already running (127.0.0.1:$PG_PORT, cluster $PG_DATA)"
    else
        if port_busy "$PG_PORT"; then echo "postgres: port $PG_PORT is taken by another process" >&2; return 1; fi
        pg_as_owner "$(pg_bin)/pg_ctl" -D "$PG_DATA" -l "$PG_DIR/run/server.log" -w -t 60 \
            -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k $PG_DIR/run -c max_connections=200" start >/dev/null \
            || { tail -n 30 "$PG_DIR/run/server.log" >&2; return 1; }
        echo "postgres: 127.0.0.1:$PG_PORT (cluster $PG_DATA, password in $PG_DIR/password)"
    fi
    for db in mlflow prefect; do
        if [[ -z "$(pg_psql -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]]; then
            pg_psql -c "CREATE DATABASE $db"
        fi
    done
}

stop_postgres() {
    if ! pg_bin >/dev/null || ! pg_running; then echo "postgres: not running"; return; fi
    pg_as_owner "$(pg_bin)/pg_ctl" -D "$PG_DATA" -m fast -w stop >/dev/null
    echo "postgres: stopped"
}

status_postgres() {
    if pg_bin >/dev/null && pg_running; then
        if pg_healthy; then echo "postgres: healthy 127.0.0.1:$PG_PORT ($PG_DATA)"; else echo "postgres: running, not healthy"; fi
    else
        echo "postgres: stopped"
    fi
}

# Where MLflow and Prefect keep their records: a team's database when its URI is set, the local cluster
# under DB=postgres, else SQLite files (the default). Sets MLFLOW_STORE_URI and PREFECT_DB_URI ("" = Prefect's own SQLite).
choose_stores() {
    MLFLOW_STORE_URI="${MEMALPHA_MLFLOW_DB_URI:-${MLFLOW_BACKEND_STORE_URI:-}}"
    PREFECT_DB_URI="${MEMALPHA_PREFECT_DB_URI:-${PREFECT_API_DATABASE_CONNECTION_URL:-}}"
    if [[ "${MEMALPHA_DB:-sqlite}" == postgres ]]; then
        if [[ -z "$MLFLOW_STORE_URI" || -z "$PREFECT_DB_URI" ]]; then start_postgres; fi
        MLFLOW_STORE_URI="${MLFLOW_STORE_URI:-postgresql+psycopg2://$PG_ROLE@127.0.0.1:$PG_PORT/mlflow}"
        PREFECT_DB_URI="${PREFECT_DB_URI:-postgresql+asyncpg://$PG_ROLE@127.0.0.1:$PG_PORT/prefect}"
    fi
    MLFLOW_STORE_URI="${MLFLOW_STORE_URI:-sqlite:///$REPO/mlruns/mlflow.db}"
}

# a URI as it may be printed: any password replaced by ***
masked() { sed -E 's#(://[^:/@]+):[^@]*@#\1:***@#' <<<"$1"; }
