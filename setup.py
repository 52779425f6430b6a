"""Installs the ``megatron`` package.

torch is deliberately not in ``install_requires``: pip would otherwise resolve it from the
registry (several GB of CUDA wheels on a CPU machine). Install the torch build you want
first (``pip install torch==2.13.0``), then this package.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-gpt",
    version="0.1.0",
    description="A Megatron-style GPT pretraining framework on PyTorch",
    packages=find_packages(include=["megatron", "megatron.*"]),
    py_modules=["pretrain_gpt"],
    python_requires=">=3.10",
    install_requires=["numpy", "pyyaml", "tensorboard"],
    extras_require={"test": ["pytest>=7", "ruff"]},
)
