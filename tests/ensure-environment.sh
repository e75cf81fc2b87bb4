#!/usr/bin/env bash
# What the test suite needs beyond the virtual environment:
# - Debian packages for the deploy/ checks and for the packet-dropping proxy mode
#   of the fault tests (below);
# - the machine's shared Postgres (127.0.0.1:5432) and NATS with JetStream
#   (127.0.0.1:4222), started the way this kind of machine starts them if down.
# Throwaway servers for the fault tests are started by the tests themselves.
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 100); do port_open "$1" && return 0; sleep 0.2; done
  echo "ensure-environment: nothing listens on 127.0.0.1:$1 ($2)" >&2
  return 1
}

# Debian packages the deploy/ checks use: promtool (in prometheus) for the alert
# rules, docker-compose for `docker-compose config`, systemd-analyze for the unit;
# nft (nftables), with which the fault tests' proxy drops the packets of its own
# loopback port; and pgbouncer.
missing=()
command -v promtool >/dev/null || missing+=(prometheus)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v systemd-analyze >/dev/null || missing+=(systemd)
command -v nft >/dev/null || missing+=(nftables)
# PgBouncer, which the pooler tests start on free loopback ports.
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "ensure-environment: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "ensure-environment: missing tools: apt-get install ${missing[*]}" >&2
    exit 1
  fi
fi

if ! port_open 5432; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "ensure-environment: starting Postgres"
    # "already running" (but not yet listening) is fine: wait_port below decides.
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  else
    echo "ensure-environment: Postgres is not running on 127.0.0.1:5432; install and start PostgreSQL 15+" >&2
    exit 1
  fi
fi
wait_port 5432 Postgres

if ! port_open 4222; then
  if [ -x /usr/sbin/nats-server ] && command -v start-stop-daemon >/dev/null; then
    echo "ensure-environment: starting NATS with JetStream"
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
  else
    echo "ensure-environment: NATS is not running on 127.0.0.1:4222; start nats-server -js" >&2
    exit 1
  fi
fi
wait_port 4222 NATS
