#!/usr/bin/env bash
# Runs longer than one device call (600 s): a run started in its own process session (setsid)
# outlives the call that started it, on the warm machine, until the machine goes back (device
# README: "Processes a command leaves running are killed when it returns, except one that started a
# new process session"). The next call, chained within the machine's 30 s of warmth, collects it.
#   bash benchmarks/bg.sh start NAME 'COMMAND'   COMMAND in the background, its output in
#                                                /tmp/bg/NAME.out, its exit status in NAME.rc
#   bash benchmarks/bg.sh wait SECS OUT [NAME...]  until the NAMEd runs (default: all) have
#                                                ended or SECS s have passed; then /tmp/bg packed
#                                                into OUT/bg.tgz (the device brings back at most
#                                                8 files a call), and each run's state printed
# From the checkout root with the bundle, e.g. the gpu suite on 2 GPUs over two calls:
#   source .devbundle/install.sh && bash benchmarks/bg.sh start suite2 \
#       'LIMIT=900 bash benchmarks/gpu_suite.sh /tmp/bg/suite2' && bash benchmarks/bg.sh wait 560 $OUT
#   source .devbundle/install.sh && bash benchmarks/bg.sh wait 560 $OUT       # the next call
set -u
B=/tmp/bg
mkdir -p "$B"
case ${1:?usage: bg.sh start NAME COMMAND | wait SECS OUT [NAME...]} in
  start)
    name=${2:?NAME}; cmd=${3:?COMMAND}
    [ -e "$B/$name.start" ] && { echo "bg.sh: $name was started already" >&2; exit 2; }
    date +%s > "$B/$name.start"
    # the exit status is written last, whole (renamed into place): a run without NAME.rc has not
    # ended; the command goes as an argument, so one that does not parse still ends with its rc (2)
    setsid nohup bash -c '( eval "$1" ); echo $? > "$2.tmp"; mv "$2.tmp" "$2"' _ "$cmd" \
        "$B/$name.rc" > "$B/$name.out" 2>&1 < /dev/null &
    echo "bg.sh: $name started (pid $!)" ;;
  wait)
    secs=${2:?SECS}; out=${3:?OUT}; shift 3
    names=("$@")
    [ ${#names[@]} -gt 0 ] || names=($(cd "$B" && ls *.start 2>/dev/null | sed 's/\.start$//'))
    end=$(( $(date +%s) + secs ))
    while [ "$(date +%s)" -lt "$end" ]; do
      left=0
      for n in "${names[@]}"; do [ -e "$B/$n.rc" ] || left=1; done
      [ $left = 0 ] && break
      sleep 5
    done
    for n in "${names[@]}"; do
      t0=$(cat "$B/$n.start" 2>/dev/null || echo 0)
      if [ -e "$B/$n.rc" ]; then
        echo "bg.sh: $n ended, rc=$(cat "$B/$n.rc"), $(( $(stat -c %Y "$B/$n.rc") - t0 )) s after its start"
      else
        echo "bg.sh: $n running, $(( $(date +%s) - t0 )) s since its start"
      fi
      tail -3 "$B/$n.out" 2>/dev/null
    done
    mkdir -p "$out"; tar czf "$out/bg.tgz" -C /tmp bg 2>/dev/null; ls -l "$out" ;;   # a file still being written: tar warns, packs
  *) echo "usage: bg.sh start NAME COMMAND | wait SECS OUT [NAME...]" >&2; exit 2 ;;
esac
