# Source on the GPU machine after .devbundle/install.sh: Python bytecode for every package, once
# per machine, as `pip install` leaves it on a user's machine.
# Why: the lent machines set PYTHONDONTWRITEBYTECODE and the bundle unpacks sources only, so every
# process (each Ray worker) compiled torch, diffusers, transformers and torchao from source: 3,220
# compile() calls, ~7.5 s of a PixArt worker's 22 s model load (warm_probe.py, 2026-11-27). The
# bytecode goes to a prefix directory (PYTHONPYCACHEPREFIX), which works where site-packages is
# not writable; processes started from this shell (Ray's workers too) inherit the variable.
export PYTHONPYCACHEPREFIX=/tmp/pycache
if [ ! -f /tmp/pycache/.done ]; then
  _t=$SECONDS
  python3 -m compileall -q -j 0 -x '/tests?/|/testing/_internal/py31[2-9]' /tmp/site \
      "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
      "$PWD/runner" "$PWD/compiler" >/dev/null 2>&1
  mkdir -p /tmp/pycache && touch /tmp/pycache/.done
  echo "pyc.sh: bytecode compiled in $((SECONDS - _t)) s into $PYTHONPYCACHEPREFIX" >&2
fi
