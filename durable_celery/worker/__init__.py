"""What binds durable to Celery: the step task, the messages it sends, and what runs inside a
worker process. May import Celery and kombu; the core below never does."""
