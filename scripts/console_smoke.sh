#!/usr/bin/env bash
# Smoke test of the operator console in a real terminal (tmux): start gputravel-console on the embedded
# default (or on --data DIR), step one complete visit with space, run the rest, take an SVG screenshot of
# every screen at 120x40 and the travel screen at 80x24 (turned into PNGs under docs/ with rsvg-convert),
# then start a second run, leave it with q, d (detach) and check it completes without the console.
#
#   scripts/console_smoke.sh [DATA_DIR]
#
# Env: OUT (PNG folder, default docs/), KEEP=1 keeps the work folder, PNG_WIDTH (default 1600).
# Needs tmux and rsvg-convert (apt-get install -y tmux librsvg2-bin; fonts-firacode for the exact font).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${GPUTRAVEL_CONSOLE:-$ROOT/.venv/bin/gputravel-console}
OUT=${OUT:-$ROOT/docs}
PNG_WIDTH=${PNG_WIDTH:-1600}
WORK=$(mktemp -d /tmp/gputravel-smoke.XXXXXX)
SESSION="gputravel-smoke-$$"
DATA_ARGS=""
if [ $# -ge 1 ]; then DATA_ARGS="--data $(cd "$1" && pwd) --holders $(find "$1" -mindepth 1 -maxdepth 1 -type d | wc -l)"; fi

for tool in tmux rsvg-convert; do
    command -v "$tool" >/dev/null || { echo "smoke: $tool is missing (apt-get install -y tmux librsvg2-bin)" >&2; exit 2; }
done

cleanup() {
    tmux kill-session -t "$SESSION" 2>/dev/null || true
    # the console's runs are their own processes and outlive it: a smoke that failed half-way stops its own
    for run in "$WORK"/run*; do
        [ -d "$run" ] && (cd "$WORK" && "$(dirname "$BIN")/gputravel" runs stop "$run" >/dev/null 2>&1) || true
    done
    if [ "${KEEP:-0}" != 1 ]; then rm -rf "$WORK"; else echo "smoke: work folder kept at $WORK"; fi
}
trap cleanup EXIT

pane() { tmux capture-pane -p -t "$SESSION"; }

# wait_for TEXT SECONDS: poll the pane until it shows TEXT
wait_for() {
    local deadline=$(( $(date +%s%N) + ${2%.*} * 1000000000 ))
    while [ "$(date +%s%N)" -lt "$deadline" ]; do
        if pane | grep -qF -- "$1"; then return 0; fi
        sleep 0.1
    done
    echo "smoke: timed out after ${2}s waiting for: $1" >&2
    pane >&2
    return 1
}

shot() {  # shot NAME: save the current screen as console-NAME.svg (:screenshot; F12 on the help overlay)
    if [ "$1" = help ]; then
        tmux send-keys -t "$SESSION" F12
    else
        tmux send-keys -t "$SESSION" ":" && wait_for ":command" 10
        tmux send-keys -t "$SESSION" "screenshot $1" Enter
    fi
    for _ in $(seq 50); do [ -s "$WORK/shots/console-$1.svg" ] && return 0; sleep 0.1; done
    echo "smoke: no screenshot console-$1.svg" >&2; return 1
}

mkdir -p "$WORK/shots" "$OUT"
t0=$(date +%s%N)
tmux new-session -d -s "$SESSION" -x 120 -y 40 \
    "cd '$WORK' && GPUTRAVEL_SCREENSHOT_DIR='$WORK/shots' '$BIN' --out '$WORK/run' --rounds 1 --steps-per-visit 10 \
     $DATA_ARGS; echo \$? > '$WORK/exit'; sleep 30"
wait_for "travel │ IDLE" 5
startup_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
echo "smoke: console up in ${startup_ms} ms"
[ "$startup_ms" -le 5000 ] || { echo "smoke: slower than 5 s to start" >&2; exit 1; }

# one complete visit, one phase per space: the status bar names the phase the run waits before
for next in HANDOFF PROVISION RETURN; do
    tmux send-keys -t "$SESSION" Space
    wait_for "PAUSED BEFORE $next" 60
done
pane > "$WORK/pane-stepping.txt"
shot travel-stepping
tmux send-keys -t "$SESSION" 4 && wait_for "SIM" 10 && sleep 1.5
shot gpu
tmux send-keys -t "$SESSION" 1 && wait_for "travel │" 5
for next in VERIFY TRAIN SCRUB ROTATE ATTEST; do
    tmux send-keys -t "$SESSION" Space
    wait_for "PAUSED BEFORE $next" 60
done
for _ in $(seq 50); do  # the run's recording is read every half second: the row follows the status
    pane > "$WORK/pane-visit1.txt"
    grep -qE "^ +1 +[^ ]+ .* done" "$WORK/pane-visit1.txt" && break
    sleep 0.2
done
grep -qE "^ +1 +[^ ]+ .* done" "$WORK/pane-visit1.txt" || { cat "$WORK/pane-visit1.txt" >&2; echo "smoke: visit 1 is not done" >&2; exit 1; }
echo "smoke: stepped one complete visit with space"

# the rest of the run on its own, then every screen
tmux send-keys -t "$SESSION" p
wait_for "COMPLETED" 300
shot travel
for pair in 2:holders 3:training 5:bench; do
    tmux send-keys -t "$SESSION" "${pair%%:*}" && wait_for " ${pair#*:} │" 10 && sleep 1
    shot "${pair#*:}"
done
tmux send-keys -t "$SESSION" 6 && wait_for "rows" 10 && tmux send-keys -t "$SESSION" v && wait_for "chain verified" 10
shot ledger
tmux send-keys -t "$SESSION" 1 && sleep 0.5 && tmux send-keys -t "$SESSION" "?" && wait_for "travel screen" 5
shot help
tmux send-keys -t "$SESSION" Escape && sleep 0.3
pane > "$WORK/pane-final.txt"
tmux resize-window -t "$SESSION" -x 80 -y 24 && sleep 1 && wait_for "COMPLETED" 10
shot travel-80x24
tmux resize-window -t "$SESSION" -x 120 -y 40 && sleep 1

# a second run, left going: q asks, d detaches, and the run (its own process) completes without the console
tmux send-keys -t "$SESSION" r
wait_for "RUNNING" 120
tmux send-keys -t "$SESSION" q && wait_for "detach" 5
pane > "$WORK/pane-quit.txt"
tmux send-keys -t "$SESSION" d
for _ in $(seq 100); do [ -s "$WORK/exit" ] && break; sleep 0.1; done
code=$(cat "$WORK/exit" 2>/dev/null || echo "none")
[ "$code" = 0 ] || { echo "smoke: gputravel-console exited with $code" >&2; exit 1; }
wait_for "detached from $WORK/run-2" 5
echo "smoke: detached with q, d; the console exited"
GT="$(dirname "$BIN")/gputravel"
for _ in $(seq 600); do
    status=$(cd "$WORK" && "$GT" runs show "$WORK/run-2" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["status"])')
    [ "$status" = running ] || break
    sleep 0.5
done
[ "$status" = completed ] || { echo "smoke: the detached run ended $status" >&2; exit 1; }
echo "smoke: the detached run completed without its console"

for svg in "$WORK"/shots/*.svg; do
    png="$OUT/$(basename "${svg%.svg}").png"
    # librsvg drops a text run's leading no-break spaces unless told to preserve them
    sed 's/<svg class="rich-terminal"/<svg xml:space="preserve" class="rich-terminal"/' "$svg" > "$svg.fixed"
    rsvg-convert -w "$PNG_WIDTH" -b "#11151C" -o "$png" "$svg.fixed"
    echo "smoke: $png"
done
