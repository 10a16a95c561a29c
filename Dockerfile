# The shop example (examples/shop.py) and durable_celery, for docker-compose.yml.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY durable_celery ./durable_celery
RUN pip install ".[test]" flower

# `celery -A examples.shop` imports the example from the working directory.
COPY examples ./examples
