"""Alembic environment for durable_celery's own tables."""

from alembic import context

from durable_celery.store.migrate import VERSION_TABLE
from durable_celery.store.schema import metadata

config = context.config
database = config.attributes["database"]
given = config.attributes.get("connection")  # the caller's (Django's migrate): committed by them

if given is not None:
    context.configure(
        connection=given,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=given.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    with database.engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            render_as_batch=database.is_sqlite,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
