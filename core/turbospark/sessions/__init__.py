"""Sessions and where they wait: the pool, the reuse rules, the prefix record, the session file and the disk tier."""
