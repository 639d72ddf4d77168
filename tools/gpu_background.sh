#!/usr/bin/env bash
# A GPU run longer than one device call (600 s): start it in the background on the warm machine, then poll it with
# back-to-back calls. The machine goes back ~30 s after a call ends, and everything under /tmp with it: do nothing
# else between the polls (runs were lost that way on 2026-11-24, twice, and on 2026-11-27).
#
#   call 1:  bash tools/gpu_background.sh start 'python3 bench/peer.py run ... --work $BG_OUT/work --out $BG_OUT'
#   call 2+: bash tools/gpu_background.sh poll 540   # up to 540 s: then $BG_OUT and the log go to $OUT, and the
#                                                    # log's tail is printed; "finished rc=N" once it has ended
#
# The command runs in a copy of the repository (/tmp/bg/repo: later calls re-sync the working tree and remove carried
# paths they do not carry), with $BG_OUT (/tmp/bg/out) for its results. Builds and installs the command needs (FA3,
# flash-attn, the vLLM bundle) go to /tmp beforehand as bench/README.md says; .gpu/vllm and .sdist are not copied.
# Send the output of anything that starts Ray (pytest's ray.init, the engine) to a file, not down a pipe: Ray's
# daemons inherit the pipe and can hold it open after the command ends, and the pipeline then waits for ever (a loop
# of Ray GPU tests stopped after its first test that way on 2026-11-27). `pkill -f` with a plain word ("raylet")
# matches the command line that names it too: write "[r]aylet".
set -euo pipefail
bg=/tmp/bg
case "${1:-}" in
  start)
    [ $# -eq 2 ] || { echo "usage: $0 start '<command>'" >&2; exit 2; }
    if [ -f $bg/pid ] && [ ! -f $bg/rc ] && kill -0 "$(cat $bg/pid)" 2>/dev/null; then
      echo "already running: $(cat $bg/cmd)" >&2; exit 1
    fi
    rm -rf $bg && mkdir -p $bg/repo $bg/out
    tar cf - --exclude=./.gpu/vllm --exclude=./.sdist --exclude=./.venv . | tar xf - -C $bg/repo
    printf '%s\n' "$2" > $bg/cmd
    (cd $bg/repo && BG_OUT=$bg/out setsid nohup bash -c "$2; echo \$? > $bg/rc" > $bg/log 2>&1 & echo $! > $bg/pid)
    echo "started in $bg/repo: $2";;
  poll)
    [ -f $bg/cmd ] || { echo "nothing started on this machine (it went cold since?)" >&2; exit 3; }
    for _ in $(seq "${2:-540}"); do [ -f $bg/rc ] && break; sleep 1; done
    tail -n 30 $bg/log
    if [ -n "${OUT:-}" ]; then cp -r $bg/out/. "$OUT"/ && cp $bg/log "$OUT"/background.log; fi
    if [ -f $bg/rc ]; then echo "finished rc=$(cat $bg/rc): $(cat $bg/cmd)"; else echo "still running: $(cat $bg/cmd)"; fi;;
  *)
    echo "usage: $0 start '<command>' | poll [seconds]" >&2; exit 2;;
esac
