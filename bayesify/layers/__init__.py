"""Converted layers: the contract they share, the one rank-1 op, and one file per layer family.

* :mod:`~bayesify.layers.base`: :class:`ConvertedLayer` (the contract), :class:`Rank1Layer`, :class:`LayerState`.
* :mod:`~bayesify.layers.rank1_op`: :func:`rank1_affine`, the rank-1 maths every family calls.
* families: :mod:`~bayesify.layers.linear`, :mod:`~bayesify.layers.conv`, :mod:`~bayesify.layers.attention`,
  :mod:`~bayesify.layers.recurrent` (with the private scan ``_scan.py``), :mod:`~bayesify.layers.bilinear`,
  :mod:`~bayesify.layers.condconv` (timm), :mod:`~bayesify.layers.hf_conv1d` (Hugging Face ``Conv1D``),
  :mod:`~bayesify.layers.embedding` (Gaussian embeddings, opt-in).
* ``_intercept.py``: keeping a layer in the compute path when other code uses its weight directly.
"""

from bayesify.layers.affine import Rank1Affine
from bayesify.layers.attention import Rank1MultiheadAttention
from bayesify.layers.base import ConvertedLayer, Draw, LayerState, Rank1Layer
from bayesify.layers.bilinear import Rank1Bilinear
from bayesify.layers.condconv import Rank1CondConv2d
from bayesify.layers.conv import Rank1Conv, Rank1ConvTranspose
from bayesify.layers.embedding import GaussianEmbedding
from bayesify.layers.hf_conv1d import Rank1HFConv1D
from bayesify.layers.linear import Rank1Linear
from bayesify.layers.rank1_op import broadcast_rows, rank1_affine
from bayesify.layers.recurrent import Rank1RNN, Rank1RNNCell
from bayesify.variational.factor import Rank1Factor

__all__ = [
    "ConvertedLayer",
    "Draw",
    "GaussianEmbedding",
    "LayerState",
    "Rank1Affine",
    "Rank1Bilinear",
    "Rank1CondConv2d",
    "Rank1Conv",
    "Rank1ConvTranspose",
    "Rank1Factor",
    "Rank1HFConv1D",
    "Rank1Layer",
    "Rank1Linear",
    "Rank1MultiheadAttention",
    "Rank1RNN",
    "Rank1RNNCell",
    "broadcast_rows",
    "rank1_affine",
]
