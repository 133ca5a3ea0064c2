from .rnn import gru, gru_backward, lstm, lstm_backward, rnn, rnn_backward
