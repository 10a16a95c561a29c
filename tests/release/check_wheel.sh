#!/usr/bin/env bash
# The release a user installs: build the wheel and the sdist, check them with twine, install the
# wheel (with its real dependencies from the index, not editable) into a fresh venv, and use it
# from an empty folder: the demo, `celery -A <app> durable --help`, `durable migrate` on a SQLite
# file and `durable web` answering a page and its stylesheet. Everything it makes lives in one
# temporary folder, removed at the end.
#
#   tests/release/check_wheel.sh            # with python3 (build and twine: the `release` extra)
#   PYTHON=python3.12 tests/release/check_wheel.sh
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/durable-release-XXXXXX")"
WEB_PID=""
cleanup() {
  if [ -n "$WEB_PID" ]; then kill "$WEB_PID" 2>/dev/null || true; wait "$WEB_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { echo "== $*"; }

step "build the sdist and the wheel (from the sdist)"
"$PYTHON" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/durable_celery-*.whl)"
SDIST="$(ls "$WORK"/dist/durable_celery-*.tar.gz)"
echo "$(basename "$WHEEL") $(basename "$SDIST")"

step "twine check"
"$PYTHON" -m twine check --strict "$WHEEL" "$SDIST"

step "install the wheel with the web extra into a fresh venv"
"$PYTHON" -m venv "$WORK/venv"
VENV_PY="$WORK/venv/bin/python"
"$VENV_PY" -m pip install --quiet "$WHEEL[web]" 2>"$WORK/pip.log" || { cat "$WORK/pip.log"; exit 1; }
mkdir "$WORK/empty"
cd "$WORK/empty"
# Only PATH (the venv's bin first) and HOME: no server address or checkout leaks in.
run() { env -i PATH="$WORK/venv/bin:/usr/bin:/bin" HOME="$WORK" PYTHONUNBUFFERED=1 "$@"; }

INSTALLED="$(run python -c 'import durable_celery; print(durable_celery.__file__, durable_celery.__version__)')"
echo "$INSTALLED"
case "$INSTALLED" in
  "$WORK/venv/"*) ;;
  *) echo "durable_celery was imported from outside the venv: $INSTALLED" >&2; exit 1 ;;
esac
EXPECTED_VERSION="$(cd "$ROOT" && "$PYTHON" -c 'import durable_celery; print(durable_celery.__version__)')"
[ "${INSTALLED##* }" = "$EXPECTED_VERSION" ] || { echo "version ${INSTALLED##* } != $EXPECTED_VERSION" >&2; exit 1; }
case "$(basename "$WHEEL")" in
  "durable_celery-$EXPECTED_VERSION-"*) ;;
  *) echo "the wheel's name does not carry version $EXPECTED_VERSION" >&2; exit 1 ;;
esac

step "python -m durable_celery demo, from an empty folder"
run python -m durable_celery demo >"$WORK/demo.txt" 2>"$WORK/demo.err" || { cat "$WORK/demo.txt" "$WORK/demo.err"; exit 1; }
diff -u "$ROOT/tests/e2e/demo_output.txt" "$WORK/demo.txt"
[ -z "$(ls -A "$WORK/empty")" ] || { echo "the demo left files behind: $(ls -A "$WORK/empty")" >&2; exit 1; }

step "celery -A tinyapp durable --help, migrate and web"
cat >"$WORK/empty/tinyapp.py" <<EOF
from celery import Celery

from durable_celery import Durable

app = Celery("tinyapp", broker="memory://")
durable = Durable(app, "sqlite:///$WORK/tiny.sqlite3")
hello = durable.workflow("hello")


@hello.step
def greet(name):
    return {"greeting": f"hello {name}"}
EOF
run celery -A tinyapp durable --help | grep -q "migrate"
run celery -A tinyapp durable migrate | tee "$WORK/migrate.txt"
grep -q "applying 0001" "$WORK/migrate.txt"
run celery -A tinyapp durable migrate --check | grep -qx "database is up to date"

PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# exec: $! is the server itself (a backgrounded `run` would be a subshell, and killing it would
# leave the server running after the folder is gone).
(exec env -i PATH="$WORK/venv/bin:/usr/bin:/bin" HOME="$WORK" PYTHONUNBUFFERED=1 \
  celery -A tinyapp durable web --port "$PORT") >"$WORK/web.log" 2>&1 &
WEB_PID=$!
"$PYTHON" - "$PORT" "$WORK/web.log" <<'EOF'
import sys, time, urllib.request

port, log = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while True:
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/runs", timeout=5).read().decode()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit("the dashboard did not answer within 60 s:\n" + open(log).read())
        time.sleep(0.2)
assert "<html" in page.lower() and "hello" in page, page[:2000]
css = urllib.request.urlopen(f"http://127.0.0.1:{port}/static/style.css", timeout=5)
assert css.status == 200 and css.read(), "the stylesheet is missing from the wheel"
print("the dashboard answered /runs and /static/style.css")
EOF
step "the release checks passed"
