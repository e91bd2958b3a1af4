"""semijax: tensor-parallel transformer training on unequal or shared devices."""

__version__ = "0.1.0"
