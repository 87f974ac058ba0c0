"""Model execution: forward context, attention backends, layers, models and weight loading."""
