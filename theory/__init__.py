"""The paper's theory at laptop scale: exact Ising models (ising.py) and the masking and
sampling experiments on them (experiments.py, `padir theory`). Independent of the
translation pipeline: imports neither `model` nor `components`."""
