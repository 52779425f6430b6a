"""Installs the ``megatron`` package.

torch is deliberately not in ``install_requires``: pip would otherwise resolve it from the
registry (several GB of CUDA wheels on a CPU machine). Install the torch build you want
first (``pip install torch==2.13.0``), then this package.
"""

import sys

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# -ffp-contract=off: no fused multiply-adds, so build_blending_indices matches its float64 Python
# reference bit for bit (GCC contracts by default where the target has FMA, e.g. aarch64).
_EXTRA_COMPILE_ARGS = ["/O2"] if sys.platform == "win32" else ["-O3", "-ffp-contract=off"]

ext_modules = [
    Pybind11Extension(
        "megatron.data._helpers",
        ["csrc/helpers.cpp"],
        cxx_std=17,
        extra_compile_args=_EXTRA_COMPILE_ARGS,
    ),
]

setup(
    name="megatron-gpt",
    version="0.1.0",
    description="A Megatron-style GPT pretraining framework on PyTorch",
    packages=find_packages(include=["megatron", "megatron.*"]),
    py_modules=["pretrain_gpt"],
    python_requires=">=3.10",
    # safetensors: tools/convert_checkpoint.py's Hugging Face files (no torch dependency of its own).
    # tqdm: megatron/progress.py's terminal bar; tokenizers already pulls it in (through huggingface-hub).
    install_requires=["numpy", "pyyaml", "tensorboard", "tokenizers", "sentencepiece", "safetensors", "tqdm"],
    # test: what the tests need to run at all (pytest, ruff, hypothesis, regex, matplotlib for plot_runs.py): a
    # quick install for the edit-test loop. reference: the reference implementations and heavy optional packages
    # the tests compare with or drive (transformers, lm-eval, accelerate, NVIDIA's megatron-core, the OpenAI client,
    # fastapi/uvicorn, W&B, tiktoken); their tests skip without them, and fail instead under
    # MEGATRON_REQUIRE_REFERENCE=1 (.ci/run installs .[test,reference] and sets it). megatron-core, pure Python
    # (numpy, packaging and the torch installed first), installs a `megatron` folder into site-packages, which
    # shadows an editable install of this package outside its checkout.
    extras_require={"serve": ["fastapi", "uvicorn"],
                    "plot": ["matplotlib"],  # tools/plot_runs.py
                    "wandb": ["wandb"],  # --wandb-project (Weights & Biases logging)
                    "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
                    # --task lm-eval, MegatronLM; [api]: tenacity, for local-completions (tools/serve.py)
                    "eval": ["lm-eval[api]>=0.4.13"],
                    "test": ["pytest>=7", "ruff", "hypothesis", "regex", "matplotlib"],
                    "reference": ["megatron-core==0.16.1", "transformers", "lm-eval[api]>=0.4.13",
                                  "accelerate",  # lm-eval's hf backend, the tests' reference
                                  "openai", "fastapi", "uvicorn", "wandb", "tiktoken"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    zip_safe=False,
)
