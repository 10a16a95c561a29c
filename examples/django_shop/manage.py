#!/usr/bin/env python
"""Django's command line for the shop: ``python manage.py migrate``, ``runserver``, ``test``."""

import os
import sys


def main() -> None:
    """Run a Django management command with the shop's settings."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
