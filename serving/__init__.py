"""The trained writer as an MLflow model: a pyfunc that turns conversations into memories, logged and
registered beside each trained adapter and served with `mlflow models serve` (`make serve`)."""
