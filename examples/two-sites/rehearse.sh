#!/bin/bash
# docs/RELAYS.md, the two-site walk-through, rehearsed on one machine: a
# folder stands for each machine, a 127.0.0.1 port for each address, and `cp` for the
# copying of public certificates. Every fedbus command is the one docs/RELAYS.md gives for
# that machine, with its address filled in (and --curve on the server site's broker,
# which turns CURVE on by itself only on a non-loopback address).
#
#   bash examples/two-sites/rehearse.sh /tmp/two-sites                  # from the repository root
#   bash examples/two-sites/rehearse.sh /tmp/two-sites --set federation.rounds=10
#
# Options after WORKDIR go to `fedbus server`. The machines:
#   S   the server site: its broker and the server
#   RA  site A's relay (its site broker on port A); A1, A2: site A's nodes (clients 0-1, 2)
#   RB  site B's relay (its site broker on port B); B1: site B's node (clients 3-5)
# Each process logs to WORKDIR/MACHINE/NAME.log. At the end it prints, per round, how
# many merged updates reached the server and the bytes it received (metrics.jsonl).
set -euo pipefail
EXAMPLE=$(cd "$(dirname "$0")" && pwd)
WORK=${1:?usage: rehearse.sh WORKDIR [fedbus server options...]}
shift
if [ -e "$WORK" ]; then
  echo "rehearse.sh: $WORK exists; give a new folder" >&2
  exit 2
fi
mkdir -p "$WORK"/{S,RA,A1,A2,RB,B1}
WORK=$(cd "$WORK" && pwd)

free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
S=127.0.0.1:$(free_port)
A=127.0.0.1:$(free_port)
B=127.0.0.1:$(free_port)

PIDS=()
# on MACHINE, in its folder: NAME COMMAND... in the background, logged to MACHINE/NAME.log
on() {
  local machine=$1 name=$2
  shift 2
  (cd "$WORK/$machine" && exec "$@" >"$name.log" 2>&1) &
  PIDS+=($!)
}
stop_all() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap stop_all EXIT

# --- 1. keys: each machine makes its own keypairs; no secret leaves its machine
(cd "$WORK/S" && fedbus keygen broker --dir keys && fedbus keygen server --dir keys)
(cd "$WORK/RA" && fedbus keygen relay-a --clients 0-2 --dir keys &&
  fedbus keygen broker --dir site-keys && fedbus keygen server --dir site-keys)
(cd "$WORK/RB" && fedbus keygen relay-b --clients 3-5 --dir keys &&
  fedbus keygen broker --dir site-keys && fedbus keygen server --dir site-keys)
(cd "$WORK/A1" && fedbus keygen node-a1 --clients 0-1 --dir keys)
(cd "$WORK/A2" && fedbus keygen node-a2 --clients 2 --dir keys)
(cd "$WORK/B1" && fedbus keygen node-b1 --clients 3-5 --dir keys)

# --- 2. exchange public certificates (*.key only)
cp "$WORK"/RA/keys/relay-a.key "$WORK"/RB/keys/relay-b.key "$WORK/S/keys/"  # S's allow-list
cp "$WORK/S/keys/broker.key" "$WORK/RA/keys/"                                # relays trust S's broker
cp "$WORK/S/keys/broker.key" "$WORK/RB/keys/"
cp "$WORK"/A1/keys/node-a1.key "$WORK"/A2/keys/node-a2.key "$WORK/RA/site-keys/"  # site A's allow-list
cp "$WORK/B1/keys/node-b1.key" "$WORK/RB/site-keys/"                         # site B's allow-list
cp "$WORK/RA/site-keys/broker.key" "$WORK/A1/keys/"                          # nodes trust their site broker
cp "$WORK/RA/site-keys/broker.key" "$WORK/A2/keys/"
cp "$WORK/RB/site-keys/broker.key" "$WORK/B1/keys/"

# --- 3. processes, in docs/RELAYS.md's order
on S broker fedbus broker --bind "tcp://$S" --curve --keys-dir keys
on S server fedbus server --broker "tcp://$S" --keys-dir keys "$EXAMPLE/server.toml" \
  --out runs/two-sites "$@"
SERVER=${PIDS[-1]}
on RA relay fedbus relay --upstream "tcp://$S" --keys-dir keys --bind "tcp://$A" --site-keys-dir site-keys
on RB relay fedbus relay --upstream "tcp://$S" --keys-dir keys --bind "tcp://$B" --site-keys-dir site-keys
on A1 node fedbus node --broker "tcp://$A" --keys-dir keys --clients 0-1
on A2 node fedbus node --broker "tcp://$A" --keys-dir keys --clients 2
on B1 node fedbus node --broker "tcp://$B" --keys-dir keys --clients 3-5

status=0
wait "$SERVER" || status=$?
if [ "$status" -ne 0 ]; then
  echo "rehearse.sh: the server exited $status; its log: $WORK/S/server.log" >&2
  tail -n 20 "$WORK/S/server.log" >&2
  exit "$status"
fi
python - "$WORK/S/runs/two-sites/metrics.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    # an async run's aggregations have no "merged" (its relays forward every update)
    print(f"round {r['round']}: merged {r.get('merged', 0)}, "
          f"participants {len(r['participants'])}, bytes_up {r['bytes_up']}, "
          f"acc_mean {r.get('acc_mean', float('nan')):.3f}")
EOF
echo "run directory: $WORK/S/runs/two-sites"
