"""What DP-SGD (strategies/dp_sgd.py) is made of: per-sample gradients (per_sample.py, with one rule per
layer type in per_sample_rules.py and factored weights in per_sample_factored.py), the privacy accountants
(accounting.py, on rdp.py and prv.py; noise calibration in calibration.py) and Poisson-sampled data
(poisson_data.py)."""
