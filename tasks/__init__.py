"""Prefect tasks: thin adapters that call memalpha and log to MLflow. They take and return paths and ids,
never models, so any task can run (or be retried) in any process."""
