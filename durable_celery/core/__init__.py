"""The rules: the key decision, step execution and the run's life. Runs in the producer and the
worker alike; takes a ``Runtime`` or one of its parts, never the ``Durable``, never Celery."""
