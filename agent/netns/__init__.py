"""netns"""
