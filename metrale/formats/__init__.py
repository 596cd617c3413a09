"""metrale.formats"""
