"""scope"""
