"""metrale.generative"""
