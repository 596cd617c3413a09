"""metrale.kv"""
