"""Training plans: the v2.0.0 plan document, the orchestration form, and the sizing and data checks behind them."""
