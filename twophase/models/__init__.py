"""Model demos built from the op library (no torch at run time): ``twophase.models.minilm``."""
