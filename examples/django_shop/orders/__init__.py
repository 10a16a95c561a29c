"""The shop's orders: a view places one, a keyed workflow fulfils it."""
