"""Packaging for ms_efficient: `pip install -e .` gives the library and the `ms-efficient` command."""
from setuptools import find_packages, setup

setup(
    name="ms_efficient",
    version="0.1.0",
    description=(
        "MindSpore extension for faster, leaner training of dense and Mixture-of-Experts "
        "models on Ascend clusters: MoE scheduling, memory planning, sharding and placement."
    ),
    python_requires=">=3.9",
    packages=find_packages(include=["ms_efficient", "ms_efficient.*"]),
    install_requires=[
        "mindspore==2.10.0",
        "numpy>=1.24,<2",
        "scipy>=1.10",
        "scipy-openblas32>=0.3.34",  # BLAS of the CPU grouped-matmul kernel
        "pulp>=2.7",
        "pyyaml>=6.0",
        "matplotlib>=3.7",
    ],
    extras_require={"test": ["pytest>=7.4"], "vision": ["mindcv==0.3.0"]},
    entry_points={"console_scripts": ["ms-efficient=ms_efficient.cli:main"]},
)
