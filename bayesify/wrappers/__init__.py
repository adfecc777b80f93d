"""Rank-1 layer wrappers, one file per layer family, and the base they share."""

from bayesify.wrappers.attention import Rank1MultiheadAttention
from bayesify.wrappers.base import Rank1Layer
from bayesify.wrappers.bilinear import Rank1Bilinear
from bayesify.wrappers.condconv import Rank1CondConv2d
from bayesify.wrappers.conv import Rank1Conv, Rank1ConvTranspose
from bayesify.wrappers.embedding import GaussianEmbedding
from bayesify.wrappers.factor import Rank1Factor
from bayesify.wrappers.linear import Rank1Linear
from bayesify.wrappers.recurrent import Rank1RNN, Rank1RNNCell

__all__ = [
    "GaussianEmbedding",
    "Rank1Bilinear",
    "Rank1CondConv2d",
    "Rank1Conv",
    "Rank1ConvTranspose",
    "Rank1Factor",
    "Rank1Layer",
    "Rank1Linear",
    "Rank1MultiheadAttention",
    "Rank1RNN",
    "Rank1RNNCell",
]
