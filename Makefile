# The README's two commands: `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# The project's packages (the folders that install under `shardline`, pyproject.toml's package-dir).
PACKAGES := shardline build cli storage quality online tasks flows observability capacity controller cost
# Nothing may reach the internet: Prefect, onnxruntime, great-expectations and MLflow telemetry off.
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export ORT_DISABLE_TELEMETRY := 1
export GX_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup bytecode dataplane demo test test-services test-fast bench typecheck clean

setup: $(VENV)/.installed bytecode dataplane

# With PYTHONDONTWRITEBYTECODE set (as in this kind of machine's shell and in most container images), Python
# writes no __pycache__, and an editable install's own modules were compiled again in every process: ~0.1-0.15 s
# of each command, server and worker start, a tenth of it (bench/README.md, "Figures behind the code"). Compiled
# here instead, into the git-ignored __pycache__ folders; a later run recompiles only what changed. Dot folders are
# left out: bench/.peers holds the bench peers' own environments (vLLM's is 3.5 GB).
bytecode: $(VENV)/.installed
	@$(PY) -m compileall -q -j 0 -x '(^|/)\.' $(PACKAGES) tests bench

# Installs Debian packages ($(1), with apt-get's options $(2)) when this is root with apt, updating the package
# lists once if the first try fails; false otherwise.
apt_install = [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	{ apt-get install -y -qq $(2) $(1) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $(2) $(1) >/dev/null 2>&1; }; }

# The data plane in front of `shardline router` (docs/routing.md "The data plane"): Debian's nginx with its Lua
# module, installed when missing and this is root with apt; without it the router relays every request itself (slower).
DATAPLANE_PACKAGES := nginx-light libnginx-mod-http-lua lua-nginx-redis lua-nginx-redis-connector
dataplane:
	@{ test -f /usr/lib/nginx/modules/ngx_http_lua_module.so && test -f /usr/share/lua/5.1/nginx/redis.lua; } || \
	  { $(call apt_install,$(DATAPLANE_PACKAGES)); } || \
	  echo "note: apt-get install $(DATAPLANE_PACKAGES) failed or is not allowed here: shardline router will relay every request itself (docs/routing.md)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[cpu,package,embedding,embedding-build,frameworks,dev,quality,mlflow,llm,capacity,kubernetes]'
	touch $@

demo: setup
	$(VENV)/bin/shardline demo

# Two processes, each given whole test files (their module fixtures stay in one): 9.7 min here where one
# process took 15.5 (most tests wait on servers they start).
test: setup typecheck test-services
	$(PY) -m pytest tests -n 2 --dist loadfile --durations=15

# What the tests run for real beside the product (Debian's packages, when missing and this is root with apt):
# redis-server behind routers sharing quotas, prometheus and promtool for the SLO rules; headless chromium laying
# out the drift report (~10 s to install here), on its own so that a failure leaves the others in. Without them
# those tests skip, saying which package to install.
TEST_PACKAGES := redis-server prometheus
BROWSER_PACKAGES := chromium
test-services:
	@command -v redis-server >/dev/null && command -v promtool >/dev/null || { $(call apt_install,$(TEST_PACKAGES),--no-install-recommends); } || \
	  echo "note: apt-get install $(TEST_PACKAGES) failed or is not allowed here: the shared-quota and SLO tests skip"
	@command -v chromium >/dev/null || { $(call apt_install,$(BROWSER_PACKAGES),--no-install-recommends); } || \
	  echo "note: apt-get install $(BROWSER_PACKAGES) failed or is not allowed here: the drift report's browser test skips"

test-fast: setup
	$(PY) -m pytest tests/unit

bench: setup
	$(PY) bench/batch_throughput.py

typecheck: setup
	$(PY) -m mypy $(PACKAGES)

# First what runs for the demo's home (shardline-demo/home), all of it from $(VENV): its batch runner, the Prefect
# workers and flow runs started with its profile (README.md, "Scheduling it in Prefect"), its Prefect server and keeper.
clean:
	if [ -x $(VENV)/bin/shardline ]; then SHARDLINE_STORAGE_HOME=$(CURDIR)/shardline-demo/home $(VENV)/bin/shardline prefect stop; fi
	rm -rf $(VENV) shardline-demo .pytest_cache
