"""Demo models and data sets for the trainer, the CLI, the examples and the benchmarks.

* :mod:`bayesify.zoo.data`: data sets by name (sklearn digits, MNIST-1D, breast cancer need no download).
* :mod:`bayesify.zoo.models`: models by name (built-ins, timm, torchvision, ``module:factory``).
"""
